//! Which logical expert fills each expert slot of a layer, and which slots stay on the GPU:
//! shared by every loader (checkpoints, KT's files, GGUF).

/// Which logical expert fills each slot, and which slots are GPU-resident: those are neither
/// read nor packed, so they cost no RAM (a forward routed to one while it is not masked is an
/// `ExpertNotLoaded` error).
#[derive(Clone, Copy, Debug, Default)]
pub struct Slots<'a> {
    /// Slot `p` holds logical expert `map[p]` (identity if `None`).
    pub map: Option<&'a [usize]>,
    /// `gpu[p]`: slot `p` is computed on the GPU.
    pub gpu: Option<&'a [bool]>,
}

impl Slots<'_> {
    /// The logical expert of slot `p`, or `None` for a GPU-resident slot.
    pub fn expert(&self, p: usize) -> Option<usize> {
        (!self.gpu.is_some_and(|g| g.get(p).copied().unwrap_or(false))).then(|| self.map.map_or(p, |m| m[p]))
    }
}
