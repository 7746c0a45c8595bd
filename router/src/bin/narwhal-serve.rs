//! `narwhal-serve`: the Narwhal router. Everything lives in the library; see
//! `narwhal_router::main_from_args` and docs/configuration.md.

fn main() -> std::process::ExitCode {
    narwhal_router::main_from_args()
}

/// jemalloc: less CPU per request than the system allocator at about the same memory
/// (docs/benchmarks.md, "The allocator").
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
