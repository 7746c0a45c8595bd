//! `narwhal-serve`: the Narwhal router. Everything lives in the library; see
//! `narwhal_router::main_from_args` and docs/configuration.md.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    narwhal_router::main_from_args()
}
