//! AFL++ entry point of the `relay` target: [`narwhal_fuzz::relay::check`] on each input
//! (tests/fuzz/run.sh builds it with `cargo afl build --features afl`).

fn main() {
    afl::fuzz!(|data: &[u8]| narwhal_fuzz::relay::check(data));
}
