//! AFL++ entry point of the `agent_protocol` target: [`narwhal_fuzz::agent_protocol::check`] on each input
//! (tests/fuzz/run.sh builds it with `cargo afl build --features afl`).

fn main() {
    afl::fuzz!(|data: &[u8]| narwhal_fuzz::agent_protocol::check(data));
}
