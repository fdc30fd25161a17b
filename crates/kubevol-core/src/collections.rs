//! Hash maps and sets keyed by kubevol's names, with a fast hasher.
//!
//! The states, the executor and the record look up every volume by its unique name and pod
//! UID several times per operation; with the standard library's SipHash that hashing was a
//! few percent of all CPU time in a storm of thousands of volumes. foldhash is several times
//! faster on such strings and, seeded at random per process, still gives no one a fixed set
//! of colliding names to feed a node.

/// A hash map with the fast hasher (create it with `Default::default()`).
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A hash set with the fast hasher (create it with `Default::default()`).
pub type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
