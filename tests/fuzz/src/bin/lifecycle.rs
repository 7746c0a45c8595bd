//! AFL++ entry point of the `lifecycle` target: [`narwhal_fuzz::lifecycle::check`] on each input
//! (tests/fuzz/run.sh builds it with `cargo afl build --features afl`).

fn main() {
    afl::fuzz!(|data: &[u8]| narwhal_fuzz::lifecycle::check(data));
}
