//! AFL++ entry point of the `kv_events` target: [`narwhal_fuzz::kv_events::check`] on each input
//! (tests/fuzz/run.sh builds it with `cargo afl build --features afl`).

fn main() {
    afl::fuzz!(|data: &[u8]| narwhal_fuzz::kv_events::check(data));
}
