//! # kt-x86
//!
//! What the x86 backends share, so that no backend crate depends on another: run-time ISA
//! detection (with the AMX tile permission Linux wants first), the AMX tile seam, KT's SwiGLU on
//! vectors, the SFT forward's LoRA products on vectors, row slices copied out to several
//! buffers, software prefetch, the VNNI `vpdpbusd` encodings, the int4 nibble coding, weight
//! buffers in per-thread huge-page arenas, the walk that cuts a task's rows into a kernel's row
//! tiles, and the instruction peaks' loops.
//!
//! **Must not** hold a backend's kernels, packing or activation layouts (those live in the
//! backend crates), nor depend on a backend crate or on the host.

#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod copy;
pub mod int4;
#[cfg(target_arch = "x86_64")]
pub mod isa;
pub mod memory;
#[cfg(target_arch = "x86_64")]
pub mod peak;
#[cfg(target_arch = "x86_64")]
pub mod prefetch;
#[cfg(target_arch = "x86_64")]
pub mod sft;
#[cfg(target_arch = "x86_64")]
pub mod swiglu;
pub mod tiles;
#[cfg(target_arch = "x86_64")]
pub mod vnni;
