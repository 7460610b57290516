//! Identifier newtypes: profile id and version, operation id and attempt id.
//!
//! Every id that crosses the API is its own type so an operation id can never
//! be passed where an attempt id is expected. Ids given by the caller are
//! checked for length here and nowhere else.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Longest accepted caller-given id or name, in bytes.
pub const ID_BYTES_MAX: usize = 256;

/// Why a caller-given id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The id was empty.
    #[error("{what} must not be empty")]
    Empty {
        /// Which id.
        what: &'static str,
    },
    /// The id was longer than [`ID_BYTES_MAX`].
    #[error("{what} must be at most {max} bytes, found {found}")]
    TooLong {
        /// Which id.
        what: &'static str,
        /// The limit.
        max: usize,
        /// The length given.
        found: usize,
    },
}

/// Checks that a caller-given id is non-empty and at most [`ID_BYTES_MAX`].
pub(crate) fn check(what: &'static str, value: &str) -> Result<(), Error> {
    if value.is_empty() {
        return Err(Error::Empty { what });
    }
    if value.len() > ID_BYTES_MAX {
        return Err(Error::TooLong {
            what,
            max: ID_BYTES_MAX,
            found: value.len(),
        });
    }
    Ok(())
}

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            /// The id as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), &*self.0)
            }
        }
    };
}

string_id!(
    /// The name of a pipeline configuration, e.g. `concepts`.
    ProfileId
);
string_id!(
    /// The version of a pipeline configuration, e.g. `v1`. Change it whenever
    /// the settings change, because policy state is keyed by it.
    ProfileVersion
);
string_id!(
    /// The caller's name for one operation; every attempt of the operation
    /// carries it, so log lines of one operation group together.
    OperationId
);

impl ProfileId {
    pub(crate) fn new(value: &str) -> Result<Self, Error> {
        check("profile id", value)?;
        Ok(ProfileId(value.into()))
    }
}

impl ProfileVersion {
    pub(crate) fn new(value: &str) -> Result<Self, Error> {
        check("profile version", value)?;
        Ok(ProfileVersion(value.into()))
    }
}

impl OperationId {
    /// Checks and wraps an operation id.
    pub fn new(value: &str) -> Result<Self, Error> {
        check("operation id", value)?;
        Ok(OperationId(value.into()))
    }
}

/// The unique id of one dispatched attempt: 128 bits, printed as 32 lower-case
/// hex digits.
///
/// The high half is derived from the pipeline's seed and the low half from a
/// per-pipeline counter passed through a bijective mixer, so ids never repeat
/// within a pipeline and look unrelated to each other.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AttemptId(u128);

impl AttemptId {
    /// The id from its 128-bit value.
    pub const fn from_u128(value: u128) -> Self {
        AttemptId(value)
    }

    /// The 128-bit value.
    pub const fn as_u128(self) -> u128 {
        self.0
    }

    /// The id as 32 lower-case hex digits.
    pub fn lower_hex(self) -> String {
        format!("{self}")
    }
}

impl fmt::Display for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::LowerHex for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::LowerHex::fmt(&self.0, f)
    }
}

impl fmt::Debug for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AttemptId({self})")
    }
}

/// SplitMix64's finaliser: a bijection on `u64` that spreads every input bit
/// over the whole output. Used for attempt ids and for the pipeline's
/// deterministic jitter draws.
pub(crate) const fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_are_checked_for_length() {
        // Goal: empty and over-long ids are refused with typed errors.
        // Method: build ids at and beyond the limits.
        assert_eq!(
            OperationId::new(""),
            Err(Error::Empty {
                what: "operation id"
            })
        );
        assert!(OperationId::new(&"x".repeat(ID_BYTES_MAX)).is_ok());
        assert!(matches!(
            OperationId::new(&"x".repeat(ID_BYTES_MAX + 1)),
            Err(Error::TooLong { found, .. }) if found == ID_BYTES_MAX + 1
        ));
    }

    #[test]
    fn attempt_id_prints_32_lower_hex_digits() {
        // Goal: attempt ids print as fixed-width lower hex.
        // Method: format small and large values.
        assert_eq!(
            AttemptId::from_u128(0xAB).lower_hex(),
            "000000000000000000000000000000ab"
        );
        assert_eq!(AttemptId::from_u128(u128::MAX).lower_hex(), "f".repeat(32));
    }

    #[test]
    fn mixer_is_injective_on_a_counter_range() {
        // Goal: consecutive counters map to distinct mixed values.
        // Method: mix the first 100k counters and count distinct outputs.
        let distinct: HashSet<u64> = (0..100_000u64).map(mix64).collect();
        assert_eq!(distinct.len(), 100_000);
    }
}
