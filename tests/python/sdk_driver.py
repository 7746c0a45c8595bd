"""Runs requests through the official `openai` Python SDK and reports what the SDK saw, as JSON.

Usage: python sdk_driver.py --base-url http://HOST:PORT/v1 < calls.json > results.json

Input (stdin): a JSON array of calls, each
  {"api": "completions" | "chat", "params": {...keyword arguments of create()...}}
`params` go to `client.completions.create` / `client.chat.completions.create` unchanged
(`stream`, `stream_options`, `stop`, `logprobs`, `n`, `tools`, ... as a user would pass them).

Output (stdout): a JSON array with one result per call, in order:
- success, non-streaming: {"ok": true, "stream": false, "response": <the parsed object, dumped>,
  "request_id" (the SDK's `_request_id`, from the `x-request-id` response header), "text",
  "finish_reason", "usage", "schema_errors"}
- success, streaming: {"ok": true, "stream": true, "chunks": [<each parsed chunk, dumped>],
  "text", "finish_reason", "usage", "schema_errors"}
  `text` joins choice 0's text / message content / delta content; `finish_reason` is choice 0's
  last non-null one; `usage` is the response's (streams: the last chunk that carried one).
  `schema_errors` lists every place where what the SDK parsed does not validate strictly against
  the SDK's own pydantic type (the SDK itself parses leniently, without validation), so an
  answer with a missing required field or a wrong type is reported instead of silently accepted.
- failure: {"ok": false, "class": <exception class name>, "mro": [<class names, most derived
  first>], "status_code": <int or null>, "message": <str>, "body": <the error body or null>}

The client never retries (max_retries=0: the tests assert on the first answer), times out after
--timeout seconds (default 60), and sends no API key of consequence. Exit status 0 whenever the
results were written, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import openai
import pydantic


def dump(obj: Any) -> Any:
    return obj.model_dump(mode="json", exclude_unset=True)


def schema_errors(obj: Any, where: str, completion_chunk: bool = False) -> list[str]:
    """Strict re-validation of an SDK object against its own type.

    A streamed completions chunk is parsed by the SDK as a `Completion`, whose `finish_reason`
    may not be null, yet OpenAI's API (and every engine) streams `finish_reason: null` until the
    last chunk; that one mismatch of the SDK's typing is not reported for such chunks.
    """
    try:
        type(obj).model_validate(dump(obj))
        return []
    except pydantic.ValidationError as e:
        return [
            f"{where}: {err['loc']}: {err['msg']}"
            for err in e.errors()
            if not (
                completion_chunk
                and err["loc"][-1:] == ("finish_reason",)
                and err.get("input") is None
            )
        ]


def choice_text(choice: Any) -> str:
    for attr in ("text",):
        if getattr(choice, attr, None):
            return getattr(choice, attr)
    msg = getattr(choice, "message", None) or getattr(choice, "delta", None)
    return (getattr(msg, "content", None) or "") if msg is not None else ""


def run_call(client: openai.OpenAI, call: dict[str, Any]) -> dict[str, Any]:
    api = call.get("api")
    params = dict(call.get("params") or {})
    if api == "completions":
        create = client.completions.create
    elif api == "chat":
        create = client.chat.completions.create
    else:
        raise ValueError(f"api: expected 'completions' or 'chat', got {api!r}")
    stream = bool(params.get("stream"))
    try:
        answer = create(**params)
        if not stream:
            choice = answer.choices[0] if answer.choices else None
            return {
                "ok": True,
                "stream": False,
                "response": dump(answer),
                "request_id": getattr(answer, "_request_id", None),
                "text": choice_text(choice) if choice is not None else "",
                "finish_reason": getattr(choice, "finish_reason", None),
                "usage": dump(answer.usage) if answer.usage is not None else None,
                "schema_errors": schema_errors(answer, "response"),
            }
        chunks, text, finish, usage, errors = [], "", None, None, []
        for i, chunk in enumerate(answer):
            chunks.append(dump(chunk))
            errors += schema_errors(chunk, f"chunk {i}", completion_chunk=api == "completions")
            for c in chunk.choices:
                if c.index == 0:
                    text += choice_text(c)
                    finish = c.finish_reason or finish
            if getattr(chunk, "usage", None) is not None:
                usage = dump(chunk.usage)
        return {
            "ok": True,
            "stream": True,
            "chunks": chunks,
            "text": text,
            "finish_reason": finish,
            "usage": usage,
            "schema_errors": errors,
        }
    except openai.OpenAIError as e:
        status = getattr(e, "status_code", None)
        body = getattr(e, "body", None)
        try:
            json.dumps(body)
        except TypeError:
            body = repr(body)
        return {
            "ok": False,
            "class": type(e).__name__,
            "mro": [k.__name__ for k in type(e).__mro__],
            "status_code": status,
            "message": getattr(e, "message", None) or str(e),
            "body": body,
        }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds")
    args = ap.parse_args(argv)
    try:
        calls = json.load(sys.stdin)
        if not isinstance(calls, list):
            raise ValueError("stdin must be a JSON array of calls")
    except ValueError as e:
        print(f"sdk_driver: bad input: {e}", file=sys.stderr)
        return 2
    client = openai.OpenAI(
        base_url=args.base_url, api_key="narwhal-test", max_retries=0, timeout=args.timeout
    )
    results = [run_call(client, call) for call in calls]
    json.dump(results, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
