//! Size limits that both the spec parser and the registry enforce, kept apart from both so neither
//! depends on the other for them.

/// The most device slots a registry has (each is a LoRA-sized buffer on the GPU: far more than fit).
pub const MAX_SLOTS: usize = 1 << 16;

/// The largest LoRA rank a config may declare and a slot pool may be sized for (`r`, a `rank_pattern`
/// value, `--max-lora-rank`): above every model's hidden size in use, so no real adapter reaches it.
/// Exported to Python so the argument helpers check it without importing torch.
pub const MAX_ADAPTER_RANK: usize = 1 << 14;

/// After how many consecutive plans that name an adapter and defer it for room it is *overdue*: the
/// next plans admit overdue adapters first, oldest first, before the batch's order. With `B` slots
/// left by the pinned adapters, a request whose adapter its scheduler keeps naming therefore waits
/// at most `OVERDUE_AFTER + ceil(W / B)` plans for room, `W` being the adapters overdue at once.
pub const OVERDUE_AFTER: u32 = 4;

/// How many unloaded names a registry remembers, so that unloading one again is a no-op (older ones
/// are then unknown).
pub const MAX_UNLOADED_NAMES: usize = 1 << 16;
