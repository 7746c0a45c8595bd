//! [`Ordered`]: a JSON object with string keys kept in the order they were written, for the
//! document parts whose key order is not sorted (engines in config order, reasons in their
//! documented order). Sorted parts use `BTreeMap`, which serialises in the same order.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A JSON object `{key: V, ...}` whose keys keep their insertion order (a parsed document keeps
/// the order it was sent in). A key written twice keeps its first position and its last value.
#[derive(Debug, Clone, PartialEq)]
pub struct Ordered<V>(Vec<(String, V)>);

impl<V> Default for Ordered<V> {
    fn default() -> Self {
        Ordered(Vec::new())
    }
}

impl<V> Ordered<V> {
    /// An empty object.
    pub fn new() -> Self {
        Ordered(Vec::new())
    }

    /// Sets `key` to `value`: in place when the key is present, else appended.
    pub fn insert(&mut self, key: impl Into<String>, value: V) {
        let key = key.into();
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.0.push((key, value)),
        }
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&V> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// `(key, value)` pairs in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The keys in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }

    /// The values in order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.0.iter().map(|(_, v)| v)
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is no key.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Into<String>, V> FromIterator<(K, V)> for Ordered<V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut m = Ordered::new();
        for (k, v) in iter {
            m.insert(k, v);
        }
        m
    }
}

impl<V> std::ops::Index<&str> for Ordered<V> {
    type Output = V;

    /// The value of `key`.
    ///
    /// # Panics
    /// When the key is absent.
    fn index(&self, key: &str) -> &V {
        self.get(key)
            .unwrap_or_else(|| panic!("no key {key:?} in the object"))
    }
}

impl<V: Serialize> Serialize for Ordered<V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Ordered<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Of<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Of<V> {
            type Value = Ordered<V>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Ordered<V>, A::Error> {
                let mut m = Ordered::new();
                while let Some((k, v)) = a.next_entry::<String, V>()? {
                    m.insert(k, v);
                }
                Ok(m)
            }
        }
        d.deserialize_map(Of(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_their_order_both_ways() {
        let m: Ordered<u64> = [("b", 1), ("a", 2), ("b", 3)].into_iter().collect();
        let text = serde_json::to_string(&m).expect("serialises");
        assert_eq!(text, r#"{"b":3,"a":2}"#);
        let back: Ordered<u64> = serde_json::from_str(r#"{"z":1,"y":2}"#).expect("parses");
        assert_eq!(back.keys().collect::<Vec<_>>(), ["z", "y"]);
        assert_eq!(back["y"], 2);
        assert_eq!(back.get("x"), None);
    }
}
