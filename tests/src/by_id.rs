//! [`ById`]: a document's per-engine map read by engine id with a message that names the id and
//! the ids there are, instead of `map["d0"]` (which panics without saying which map).

use std::collections::BTreeMap;
use std::fmt::Debug;

/// Reads a per-engine map of a typed document (`Lifecycle::engines`, `State::resident`,
/// `Lifecycle::process_starts`, ...) by engine id.
pub trait ById<V> {
    /// The entry of engine `id`.
    ///
    /// # Panics
    /// When the map has no entry for `id`; the message lists the ids it has.
    fn of(&self, id: &str) -> &V;
}

impl<V: Debug> ById<V> for BTreeMap<String, V> {
    fn of(&self, id: &str) -> &V {
        self.get(id).unwrap_or_else(|| {
            let ids: Vec<&String> = self.keys().collect();
            panic!("no entry for engine {id:?}; the map has {ids:?}")
        })
    }
}
