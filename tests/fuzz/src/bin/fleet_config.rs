//! AFL++ entry point of the `fleet_config` target: [`narwhal_fuzz::fleet_config::check`] on each input
//! (tests/fuzz/run.sh builds it with `cargo afl build --features afl`).

fn main() {
    afl::fuzz!(|data: &[u8]| narwhal_fuzz::fleet_config::check(data));
}
