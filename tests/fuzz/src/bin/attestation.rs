//! AFL++ entry point of the `attestation` target: [`narwhal_fuzz::attestation::check`] on each input
//! (tests/fuzz/run.sh builds it with `cargo afl build --features afl`).

fn main() {
    afl::fuzz!(|data: &[u8]| narwhal_fuzz::attestation::check(data));
}
