//! The Jinja environment a chat template renders in, made to behave as Hugging Face
//! transformers' `render_jinja_template` does (the code vLLM's chat path renders with):
//!
//! - `trim_blocks` and `lstrip_blocks` on, one trailing newline of the template dropped (Jinja's
//!   `keep_trailing_newline` off), `{% break %}` / `{% continue %}` (jinja2's loopcontrols);
//! - the globals `raise_exception(message)` (the render fails with the message) and
//!   `strftime_now(format)` (the current time, formatted);
//! - the filter `tojson` as transformers defines it: Python's `json.dumps` with
//!   `ensure_ascii=False`, key order kept, `(", ", ": ")` separators without `indent` and
//!   `(",", ": ")` with it ([`to_json`]);
//! - Python's string and dict methods (`.strip()`, `.items()`, ...) from minijinja-contrib.
//!
//! Where it still departs from jinja2 (a filter or method minijinja lacks, a number printed
//! otherwise) the render fails or differs; the router's sampled agreement check against the
//! engine's own `/tokenize` catches a difference (docs/design/kv-aware-placement.md, "The
//! router's tokenizer").

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

/// The name the chat template is kept under.
pub(crate) const CHAT: &str = "chat";

/// An environment holding `source` as template [`CHAT`].
///
/// # Errors
/// The template's syntax error, as minijinja words it.
pub(crate) fn environment(source: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_template_owned(CHAT, source)?;
    Ok(env)
}

/// `source` without transformers' `{% generation %}` / `{% endgeneration %}` tags (its
/// `AssistantTracker` extension marks the assistant's tokens with them and renders what they
/// enclose as it is; vLLM never asks for the mask), which minijinja does not know.
pub(crate) fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}") else {
            break;
        };
        let tag = &rest[start + 2..start + len];
        let word = tag.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..start]);
        if word != "generation" && word != "endgeneration" {
            out.push_str(&rest[start..start + len + 2]);
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

/// `raise_exception(message)`: the template refuses the request (a template's own check, such
/// as "roles must alternate").
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current time (UTC) in Python's `strftime` format, for the
/// directives templates use (`%Y %y %m %d %e %b %B %a %A %H %I %M %S %p %j %%`); any other is an
/// error (the request then falls back to the engine's `/tokenize`). transformers formats the
/// engine host's local time: a container's zone is UTC unless set otherwise.
fn strftime_now(format: String) -> Result<Value, Error> {
    strftime(&format, time::OffsetDateTime::now_utc()).map(Value::from)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Python's `strftime` of `t` for the directives [`strftime_now`] names.
fn strftime(format: &str, t: time::OffsetDateTime) -> Result<String, Error> {
    let mut out = String::new();
    let mut chars = format.chars();
    let month = MONTHS[usize::from(u8::from(t.month())) - 1];
    let day = DAYS[usize::from(t.weekday().number_days_from_monday())];
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let d = chars.next().unwrap_or('%');
        let hour12 = match t.hour() % 12 {
            0 => 12,
            h => h,
        };
        let _ = match d {
            'Y' => write!(out, "{}", t.year()),
            'y' => write!(out, "{:02}", t.year().rem_euclid(100)),
            'm' => write!(out, "{:02}", u8::from(t.month())),
            'd' => write!(out, "{:02}", t.day()),
            'e' => write!(out, "{:>2}", t.day()),
            'b' => write!(out, "{}", &month[..3]),
            'B' => write!(out, "{month}"),
            'a' => write!(out, "{}", &day[..3]),
            'A' => write!(out, "{day}"),
            'H' => write!(out, "{:02}", t.hour()),
            'I' => write!(out, "{hour12:02}"),
            'M' => write!(out, "{:02}", t.minute()),
            'S' => write!(out, "{:02}", t.second()),
            'p' => write!(out, "{}", if t.hour() < 12 { "AM" } else { "PM" }),
            'j' => write!(out, "{:03}", t.ordinal()),
            '%' => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: directive %{other} is not supported"),
                ));
            }
        };
    }
    Ok(out)
}

/// The `tojson` filter: `value|tojson(indent=None, separators=None, sort_keys=False,
/// ensure_ascii=False)` as transformers defines it ([`to_json`]).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([i, k]) => (i.clone(), k.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ));
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = Style {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    to_json(value, &style, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// How [`to_json`] writes: Python `json.dumps`'s arguments.
#[derive(Debug, Clone)]
pub(crate) struct Style {
    /// `indent`: spaces per level, each item on its own line; `None`: one line.
    pub(crate) indent: Option<usize>,
    /// The separator after an item (before a newline when indenting).
    pub(crate) item: String,
    /// The separator between a key and its value.
    pub(crate) key: String,
    /// Keys sorted (by code point) rather than in insertion order.
    pub(crate) sort_keys: bool,
    /// Non-ASCII characters written as `\uXXXX` escapes (UTF-16 pairs beyond the BMP).
    pub(crate) ensure_ascii: bool,
}

/// `value` as Python's `json.dumps` writes it with `style`: `None` and undefined as `null`,
/// integers as integers, floats as Python's `repr` ([`python_float`]), strings with Python's
/// escapes.
///
/// # Errors
/// A value JSON cannot hold (bytes, a callable).
pub(crate) fn to_json(
    value: &Value,
    style: &Style,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = style.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => {
            let f = f64::try_from(value.clone())?;
            out.push_str(&python_float(f));
        }
        ValueKind::String => json_string(value.as_str().unwrap_or(""), style.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item);
                }
                newline(out, depth + 1);
                to_json(v, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort_by_key(ToString::to_string);
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item);
                }
                newline(out, depth + 1);
                json_string(&k.to_string(), style.ensure_ascii, out);
                out.push_str(&style.key);
                to_json(&value.get_item(k)?, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {} is not JSON", value.kind()),
            ));
        }
    }
    Ok(())
}

/// A JSON string as Python writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other control
/// characters as `\u00XX`, the rest as they are (or escaped with `ensure_ascii`).
fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr` writes it: the shortest digits that read back the same, in
/// positional notation for decimal exponents -4 to 15 (always with a fraction: `1.0`), else
/// scientific with a signed two-digit-or-more exponent (`1e+16`, `1.5e-05`); `NaN`,
/// `Infinity`, `-Infinity` as `json.dumps` writes them.
pub(crate) fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: `d[.ddd]e[-]x`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
        } else {
            let point = point as usize;
            if digits.len() <= point {
                format!("{digits}{}.0", "0".repeat(point - digits.len()))
            } else {
                format!("{}.{}", &digits[..point], &digits[point..])
            }
        };
        return format!("{sign}{body}");
    }
    let mantissa = if digits.len() > 1 {
        format!("{}.{}", &digits[..1], &digits[1..])
    } else {
        digits
    };
    let esign = if exp < 0 { '-' } else { '+' };
    format!("{sign}{mantissa}e{esign}{:02}", exp.unsigned_abs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> Result<String, Error> {
        let env = environment(source.to_string())?;
        env.get_template(CHAT)?.render(ctx)
    }

    #[test]
    fn generation_tags_render_what_they_enclose() {
        let t = without_generation_tags(
            "a{% generation %}b{%- endgeneration -%}c{% if x %}d{% endif %}",
        );
        assert_eq!(t, "abc{% if x %}d{% endif %}");
    }

    #[test]
    fn floats_read_as_python_repr_writes_them() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123_456_789.0, "123456789.0"),
            (1e15, "1000000000000000.0"),
            (0.1 + 0.2, "0.30000000000000004"),
        ] {
            assert_eq!(python_float(f), want, "{f}");
        }
    }

    #[test]
    fn tojson_writes_what_json_dumps_writes() {
        let v = Value::from_serialize(serde_json::json!({
            "name": "get_weather", "n": 3, "x": 1.0, "ok": true, "none": null,
            "s": "a\"b\\c\nd\u{1}é", "list": [1, [], {}]
        }));
        let env = environment("{{ v|tojson }}|{{ v|tojson(indent=2) }}".into()).expect("env");
        let out = env
            .get_template(CHAT)
            .expect("t")
            .render(minijinja::context! { v => v.clone() })
            .expect("render");
        let (one, indented) = out.split_once('|').expect("two");
        assert_eq!(
            one,
            r#"{"name": "get_weather", "n": 3, "x": 1.0, "ok": true, "none": null, "s": "a\"b\\c\nd\u0001é", "list": [1, [], {}]}"#
        );
        assert!(indented.starts_with("{\n  \"name\": \"get_weather\",\n  \"n\": 3,"));
        assert!(indented.ends_with("  \"list\": [\n    1,\n    [],\n    {}\n  ]\n}"));
    }

    #[test]
    fn blocks_are_trimmed_and_a_template_can_refuse() {
        let t = "{% for m in messages %}\n  {{ m.content.strip() }}|\n{% endfor %}\n";
        let ctx = Value::from_serialize(serde_json::json!({"messages": [
            {"content": " a "}, {"content": "b"}]}));
        // `lstrip_blocks` strips before a block tag only, as in jinja2.
        assert_eq!(render(t, ctx).expect("render"), "  a|\n  b|\n");
        let refuse = "{{ raise_exception('roles must alternate') }}";
        let err = render(refuse, Value::from(())).expect_err("refused");
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn strftime_follows_python_for_the_directives_templates_use() {
        let t = time::macros::datetime!(2026-03-07 09:05:01 UTC);
        assert_eq!(
            strftime("%d %b %Y %A %H:%M:%S %p %I %j %%", t).expect("ok"),
            "07 Mar 2026 Saturday 09:05:01 AM 09 066 %"
        );
        assert!(strftime("%Z", t).is_err());
    }
}
