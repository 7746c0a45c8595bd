//! AFL++ entry point of the `ingress` target: [`narwhal_fuzz::ingress::check`] on each input
//! (tests/fuzz/run.sh builds it with `cargo afl build --features afl`).

fn main() {
    afl::fuzz!(|data: &[u8]| narwhal_fuzz::ingress::check(data));
}
