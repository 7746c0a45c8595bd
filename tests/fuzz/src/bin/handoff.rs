//! AFL++ entry point of the `handoff` target: [`narwhal_fuzz::handoff::check`] on each input
//! (tests/fuzz/run.sh builds it with `cargo afl build --features afl`).

fn main() {
    afl::fuzz!(|data: &[u8]| narwhal_fuzz::handoff::check(data));
}
