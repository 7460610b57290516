//! A msgpack deserializer over one in-memory record body: the fast path
//! of [`crate::codec::decode_body`].
//!
//! Every record keel reads is a complete byte slice, so this reader needs
//! none of the general reader's machinery (a `Read` abstraction, a marker
//! held back between calls, io errors built and dropped). It reads the
//! same msgpack that `rmp_serde` writes and hands the visitor exactly what
//! `rmp_serde`'s deserializer hands it, marker by marker (a positive fixint
//! is a `u8`, a `u16` marker a `u16`, strings and byte strings are borrowed
//! from the body).
//!
//! It refuses, with the payload-free [`Refused`], everything it does not
//! read the way `rmp_serde` does: invalid UTF-8 (which `rmp_serde` hands
//! over as bytes), extension types, 128-bit integers, nesting deeper than
//! [`BODY_NESTING_MAX`]. A refusal is remembered even when the type being
//! decoded catches it (a lenient field that takes the default on any
//! error): the reader may then stand elsewhere in the body than
//! `rmp_serde`'s would, so the whole decode is refused. A refusal is never
//! an answer: the caller then
//! decodes the body again with `rmp_serde`, which either succeeds or
//! produces the exact typed error. So this reader can only make a decode
//! faster, never change its outcome (the codec property tests compare the
//! two on valid, damaged and arbitrary bodies).

use serde::de::{self, DeserializeSeed, Visitor};
use std::cell::Cell;
use std::fmt;

/// Deepest nesting of arrays and maps this reader follows before it
/// refuses: the body's own limit, so a body it refuses for depth alone is
/// refused for good (see [`BODY_NESTING_MAX`]).
pub(crate) const SLICE_DEPTH_MAX: u32 = BODY_NESTING_MAX;

/// Deepest nesting of non-empty arrays and maps (an enum variant with data
/// is a map of one entry) a record body or payload may have; deeper is
/// refused with a typed error, and a client is refused such a payload
/// before it is sent. Decoding recurses once per level on the decoding
/// thread's stack, and each level's frame holds a value of the type being
/// decoded; `rmp_serde` does not count enum variants in its own limit, so
/// without this one a recursive enum nested deeply enough overflowed the
/// stack and aborted the process. 128 is also `serde_json`'s default.
pub const BODY_NESTING_MAX: u32 = 128;

/// Whether `body` nests non-empty arrays and maps at most `limit` deep,
/// walked without recursion. A body cut short, or damaged, answers for
/// what it holds: what the walk read before it ran out was not too deep.
pub(crate) fn nests_within(body: &[u8], limit: u32) -> bool {
    // Items still to read in each open container; the bottom one is the
    // body's single value.
    let mut open: Vec<u64> = vec![1];
    let mut at = 0usize;
    let be = |from: usize, n: usize| -> Option<u64> {
        let bytes = body.get(from..from.checked_add(n)?)?;
        Some(bytes.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    };
    loop {
        while open.last() == Some(&0) {
            open.pop();
        }
        let Some(left) = open.last_mut() else {
            return true;
        };
        *left -= 1;
        let Some(&marker) = body.get(at) else {
            return true;
        };
        at += 1;
        // A container's items, or the bytes a scalar, string or
        // extension spans after its marker.
        let (items, skip) = match marker {
            0x80..=0x8f => (Some(2 * u64::from(marker & 0x0f)), 0),
            0x90..=0x9f => (Some(u64::from(marker & 0x0f)), 0),
            0xdc..=0xdf => {
                let width = if matches!(marker, 0xde | 0xdc) { 2 } else { 4 };
                let Some(n) = be(at, width) else {
                    return true;
                };
                at += width;
                let per = if matches!(marker, 0xde | 0xdf) { 2 } else { 1 };
                (Some(per * n), 0)
            }
            0xa0..=0xbf => (None, u64::from(marker & 0x1f)),
            0xc4 | 0xd9 | 0xc5 | 0xda | 0xc6 | 0xdb => {
                let width = match marker {
                    0xc4 | 0xd9 => 1,
                    0xc5 | 0xda => 2,
                    _ => 4,
                };
                let Some(n) = be(at, width) else {
                    return true;
                };
                at += width;
                (None, n)
            }
            // Extensions: a type byte and their data.
            0xd4 => (None, 2),
            0xd5 => (None, 3),
            0xd6 => (None, 5),
            0xd7 => (None, 9),
            0xd8 => (None, 17),
            0xc7..=0xc9 => {
                let width = 1usize << (marker - 0xc7);
                let Some(n) = be(at, width) else {
                    return true;
                };
                at += width;
                (None, n + 1)
            }
            0xcc | 0xd0 => (None, 1),
            0xcd | 0xd1 => (None, 2),
            0xce | 0xd2 | 0xca => (None, 4),
            0xcf | 0xd3 | 0xcb => (None, 8),
            _ => (None, 0),
        };
        match items {
            Some(0) | None => {
                let Some(next) = usize::try_from(skip).ok().and_then(|s| at.checked_add(s)) else {
                    return true;
                };
                at = next;
            }
            Some(n) => {
                if open.len() > limit as usize {
                    return false;
                }
                open.push(n);
            }
        }
    }
}

/// The fast reader could not decode the body the way `rmp_serde` would:
/// decode it again with `rmp_serde`. Carries no message, so refusing costs
/// nothing.
#[derive(Debug)]
pub(crate) struct Refused;

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("refused by the slice reader")
    }
}

impl std::error::Error for Refused {}

impl de::Error for Refused {
    fn custom<T: fmt::Display>(_msg: T) -> Self {
        Refused
    }
}

type Result<T> = std::result::Result<T, Refused>;

/// Decodes `T` from the whole of `body`; [`Refused`] for anything else,
/// including bytes left after the value.
pub(crate) fn from_slice<'de, T: de::Deserialize<'de>>(body: &'de [u8]) -> Result<T> {
    read(body, false)
}

/// [`from_slice`] for keel's own records, whose types all derive their
/// `Deserialize` and flatten nothing: their variant and field names are
/// handed over as bytes, unchecked as UTF-8 (see
/// [`SliceReader::names_as_bytes`]). Not for users' types: a name handed
/// over as bytes can decode differently from one handed over as a string
/// (a `#[serde(flatten)]` into a JSON value takes string keys only, and an
/// `Option` around it turns the difference into `None`, not an error).
pub(crate) fn from_record_slice<'de, T: de::Deserialize<'de>>(body: &'de [u8]) -> Result<T> {
    read(body, true)
}

fn read<'de, T: de::Deserialize<'de>>(body: &'de [u8], names_as_bytes: bool) -> Result<T> {
    let mut reader = SliceReader {
        body,
        at: 0,
        depth: 0,
        refused: Cell::new(false),
        names_as_bytes,
    };
    let value = T::deserialize(&mut reader)?;
    if reader.at != body.len() || reader.refused.get() {
        return Err(Refused);
    }
    Ok(value)
}

/// What a marker with a length opens.
enum Opens {
    Map,
    Array,
    Str,
    Bin,
}

struct SliceReader<'de> {
    body: &'de [u8],
    at: usize,
    depth: u32,
    /// Set by every refusal, so one the decoded type caught still refuses
    /// the whole body.
    refused: Cell<bool>,
    /// Identifiers (variant and field names) go to the visitor as bytes,
    /// without a UTF-8 check: serde's derived identifiers match bytes as
    /// they match strings, and the check was a tenth of decoding an event
    /// (a variant name per event). Only for keel's own records
    /// ([`from_record_slice`]).
    names_as_bytes: bool,
}

impl<'de> SliceReader<'de> {
    #[cold]
    fn refuse<T>(&self) -> Result<T> {
        self.refused.set(true);
        Err(Refused)
    }

    #[inline]
    fn peek(&self) -> Result<u8> {
        match self.body.get(self.at) {
            Some(b) => Ok(*b),
            None => self.refuse(),
        }
    }

    #[inline]
    fn byte(&mut self) -> Result<u8> {
        let b = self.peek()?;
        self.at += 1;
        Ok(b)
    }

    #[inline]
    fn take(&mut self, len: usize) -> Result<&'de [u8]> {
        let Some(bytes) = self
            .at
            .checked_add(len)
            .and_then(|end| self.body.get(self.at..end))
        else {
            return self.refuse();
        };
        self.at += len;
        Ok(bytes)
    }

    #[inline]
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let bytes = self.take(N)?;
        let mut out = [0; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn len8(&mut self) -> Result<usize> {
        Ok(self.byte()? as usize)
    }

    fn len16(&mut self) -> Result<usize> {
        Ok(u16::from_be_bytes(self.array()?) as usize)
    }

    fn len32(&mut self) -> Result<usize> {
        Ok(u32::from_be_bytes(self.array()?) as usize)
    }

    /// A number, a boolean or nil, as `rmp_serde` reads it for a scalar
    /// (anything else is refused here, as it is an error there).
    fn scalar<V: Visitor<'de>>(&mut self, marker: u8, visitor: V) -> Result<V::Value> {
        match marker {
            0x00..=0x7f => visitor.visit_u8(marker),
            0xe0..=0xff => visitor.visit_i8(marker as i8),
            0xc0 => visitor.visit_unit(),
            0xc2 => visitor.visit_bool(false),
            0xc3 => visitor.visit_bool(true),
            0xcc => visitor.visit_u8(self.byte()?),
            0xcd => visitor.visit_u16(u16::from_be_bytes(self.array()?)),
            0xce => visitor.visit_u32(u32::from_be_bytes(self.array()?)),
            0xcf => visitor.visit_u64(u64::from_be_bytes(self.array()?)),
            0xd0 => visitor.visit_i8(self.byte()? as i8),
            0xd1 => visitor.visit_i16(i16::from_be_bytes(self.array()?)),
            0xd2 => visitor.visit_i32(i32::from_be_bytes(self.array()?)),
            0xd3 => visitor.visit_i64(i64::from_be_bytes(self.array()?)),
            0xca => visitor.visit_f32(f32::from_be_bytes(self.array()?)),
            0xcb => visitor.visit_f64(f64::from_be_bytes(self.array()?)),
            _ => self.refuse(),
        }
    }

    /// For a marker that has a length (a map, an array, a string, a byte
    /// string), what it opens and the length, read after the marker; `None`
    /// for the others, with nothing read.
    #[inline(always)]
    fn sized(&mut self, marker: u8) -> Result<Option<(Opens, usize)>> {
        let (what, len) = match marker {
            0x80..=0x8f => return Ok(Some((Opens::Map, (marker & 0x0f) as usize))),
            0x90..=0x9f => return Ok(Some((Opens::Array, (marker & 0x0f) as usize))),
            0xa0..=0xbf => return Ok(Some((Opens::Str, (marker & 0x1f) as usize))),
            0xc4 => (Opens::Bin, self.len8()),
            0xc5 => (Opens::Bin, self.len16()),
            0xc6 => (Opens::Bin, self.len32()),
            0xd9 => (Opens::Str, self.len8()),
            0xda => (Opens::Str, self.len16()),
            0xdb => (Opens::Str, self.len32()),
            0xdc => (Opens::Array, self.len16()),
            0xdd => (Opens::Array, self.len32()),
            0xde => (Opens::Map, self.len16()),
            0xdf => (Opens::Map, self.len32()),
            _ => return Ok(None),
        };
        Ok(Some((what, len?)))
    }

    /// Any value. `bytes_as_bytes` is false where `rmp_serde` would hand a
    /// byte string to the visitor as a sequence of numbers (a sequence,
    /// tuple or struct was asked for): refused here.
    #[inline(always)]
    fn any<V: Visitor<'de>>(&mut self, visitor: V, bytes_as_bytes: bool) -> Result<V::Value> {
        let marker = self.byte()?;
        match self.sized(marker)? {
            Some((Opens::Map, len)) => self.map(visitor, len),
            Some((Opens::Array, len)) => self.seq(visitor, len),
            Some((Opens::Str, len)) => self.str(visitor, len),
            Some((Opens::Bin, len)) if bytes_as_bytes => {
                visitor.visit_borrowed_bytes(self.take(len)?)
            }
            Some((Opens::Bin, _)) => self.refuse(),
            None => self.scalar(marker, visitor),
        }
    }

    fn str<V: Visitor<'de>>(&mut self, visitor: V, len: usize) -> Result<V::Value> {
        let bytes = self.take(len)?;
        // Invalid UTF-8 is handed over as bytes by `rmp_serde`: refused here.
        match std::str::from_utf8(bytes) {
            Ok(text) => visitor.visit_borrowed_str(text),
            Err(_) => self.refuse(),
        }
    }

    #[inline(always)]
    fn nested<T>(&mut self, read: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.depth >= SLICE_DEPTH_MAX {
            return self.refuse();
        }
        self.depth += 1;
        let out = read(self);
        self.depth -= 1;
        out
    }

    #[inline(always)]
    fn seq<V: Visitor<'de>>(&mut self, visitor: V, len: usize) -> Result<V::Value> {
        self.nested(|de| {
            let mut items = Items { de, left: len };
            let value = visitor.visit_seq(&mut items)?;
            if items.left != 0 {
                return items.de.refuse();
            }
            Ok(value)
        })
    }

    #[inline(always)]
    fn map<V: Visitor<'de>>(&mut self, visitor: V, len: usize) -> Result<V::Value> {
        self.nested(|de| {
            let mut items = Items { de, left: len };
            let value = visitor.visit_map(&mut items)?;
            if items.left != 0 {
                return items.de.refuse();
            }
            Ok(value)
        })
    }
}

/// The elements of an array, or the entries of a map, still to be read.
struct Items<'a, 'de> {
    de: &'a mut SliceReader<'de>,
    left: usize,
}

impl<'de> de::SeqAccess<'de> for Items<'_, 'de> {
    type Error = Refused;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(&mut *self.de).map(Some)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.left)
    }
}

impl<'de> de::MapAccess<'de> for Items<'_, 'de> {
    type Error = Refused;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(&mut *self.de).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value> {
        seed.deserialize(&mut *self.de)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.left)
    }
}

/// An enum as rmp-serde writes it: a map of one entry, the variant's name
/// then its body (nil for a unit variant); or, `bare`, the name alone,
/// which only a unit variant may be.
struct Variant<'a, 'de> {
    de: &'a mut SliceReader<'de>,
    bare: bool,
}

impl<'a, 'de> Variant<'a, 'de> {
    /// The reader, for a variant with a body; refused for a bare name.
    fn body(self) -> Result<&'a mut SliceReader<'de>> {
        if self.bare {
            return self.de.refuse();
        }
        Ok(self.de)
    }
}

impl<'de> de::EnumAccess<'de> for Variant<'_, 'de> {
    type Error = Refused;
    type Variant = Self;

    fn variant_seed<V: DeserializeSeed<'de>>(self, seed: V) -> Result<(V::Value, Self)> {
        let name = seed.deserialize(&mut *self.de)?;
        Ok((name, self))
    }
}

impl<'de> de::VariantAccess<'de> for Variant<'_, 'de> {
    type Error = Refused;

    fn unit_variant(self) -> Result<()> {
        if self.bare {
            return Ok(());
        }
        match self.de.byte()? {
            0xc0 => Ok(()),
            _ => self.de.refuse(),
        }
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value> {
        seed.deserialize(self.body()?)
    }

    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value> {
        self.body()?.any(visitor, false)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        self.body()?.any(visitor, false)
    }
}

macro_rules! scalars {
    ($($name:ident)*) => {
        $(
            #[inline]
            fn $name<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
                let marker = self.byte()?;
                self.scalar(marker, visitor)
            }
        )*
    };
}

impl<'de> de::Deserializer<'de> for &mut SliceReader<'de> {
    type Error = Refused;

    fn is_human_readable(&self) -> bool {
        // As `rmp_serde`'s: ids and times take their compact forms.
        false
    }

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.any(visitor, true)
    }

    scalars! {
        deserialize_bool deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64
        deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64
        deserialize_f32 deserialize_f64
    }

    fn deserialize_i128<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value> {
        self.refuse()
    }

    fn deserialize_u128<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value> {
        self.refuse()
    }

    fn deserialize_char<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.any(visitor, true)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.any(visitor, true)
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.any(visitor, true)
    }

    fn deserialize_bytes<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.any(visitor, true)
    }

    fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.any(visitor, true)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        if self.peek()? == 0xc0 {
            self.at += 1;
            visitor.visit_none()
        } else {
            visitor.visit_some(self)
        }
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.any(visitor, true)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value> {
        // Written as an empty array; nil is read too, as `rmp_serde` does.
        match self.peek()? {
            0xc0 | 0x90 => {
                self.at += 1;
                visitor.visit_unit()
            }
            _ => self.any(visitor, true),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value> {
        if name == rmp_serde::MSGPACK_EXT_STRUCT_NAME {
            return self.refuse();
        }
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.any(visitor, false)
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value> {
        self.any(visitor, false)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value> {
        self.any(visitor, false)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.any(visitor, true)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        self.any(visitor, false)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        let marker = self.peek()?;
        if !matches!(marker, 0x80..=0x8f | 0xde | 0xdf) {
            // Not a map: the variant's name alone.
            return visitor.visit_enum(Variant {
                de: self,
                bare: true,
            });
        }
        self.at += 1;
        let len = match self.sized(marker)? {
            Some((Opens::Map, len)) => len,
            _ => return self.refuse(),
        };
        if len != 1 {
            return self.refuse();
        }
        // Counted like an array: an enum can nest itself through its body.
        self.nested(|de| visitor.visit_enum(Variant { de, bare: false }))
    }

    /// A record's variant or field name is handed over as bytes (see
    /// [`SliceReader::names_as_bytes`]). Invalid UTF-8 then fails as an
    /// unknown name, as with `rmp_serde`, which hands such a name over as
    /// bytes too; any failure here refuses the whole body, even one the
    /// decoded type would catch, so `rmp_serde` reads it instead.
    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        if self.names_as_bytes {
            let start = self.at;
            let marker = self.byte()?;
            if let Some((Opens::Str, len)) = self.sized(marker)? {
                let name = self.take(len)?;
                return visitor
                    .visit_borrowed_bytes(name)
                    .inspect_err(|_| self.refused.set(true));
            }
            // Not a string: read from its marker again, as any value.
            self.at = start;
        }
        self.any(visitor, true)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.any(visitor, true)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    // Goal: the slice reader reads every msgpack marker and every serde
    // shape keel's records use, and hands the visitor what rmp-serde's
    // reader does; a refusal would silently cost the fast path, a wrong
    // value would corrupt a record.
    // Method: values at the edges of each marker (fixint to 64-bit, fixstr
    // to str32, bin8 to bin32, fixarray to array32, fixmap to map32),
    // enums of every variant shape, options and unit structs; each
    // encoded by rmp-serde positionally and with field names, then read by
    // both readers. The fast reader must accept and agree.
    use super::*;
    use serde::{de::DeserializeOwned, Deserialize, Serialize};
    use std::collections::BTreeMap;
    use std::fmt::Debug;

    fn both<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T) {
        for body in [
            rmp_serde::to_vec(value).unwrap(),
            rmp_serde::to_vec_named(value).unwrap(),
        ] {
            let slow: T = rmp_serde::from_slice(&body).unwrap();
            for (fast, mode) in [
                (from_slice::<T>(&body), "payload"),
                (from_record_slice::<T>(&body), "record"),
            ] {
                let fast = fast.unwrap_or_else(|_| {
                    panic!(
                        "{mode}: refused {value:?} from {:02x?}",
                        &body[..body.len().min(16)]
                    )
                });
                assert_eq!(fast, slow, "{mode}");
                assert_eq!(&fast, value, "{mode}");
            }
        }
    }

    /// Unsigned values at the edge of each msgpack integer marker (also
    /// used by `slice_ser`'s tests).
    pub(crate) const UNSIGNED_EDGES: [u64; 11] = [
        0,
        1,
        127,
        128,
        255,
        256,
        65_535,
        65_536,
        u32::MAX as u64,
        u32::MAX as u64 + 1,
        u64::MAX,
    ];

    /// Signed values at the edge of each msgpack integer marker.
    pub(crate) const SIGNED_EDGES: [i64; 12] = [
        0,
        -1,
        -32,
        -33,
        -128,
        -129,
        -32_768,
        -32_769,
        i32::MIN as i64,
        i32::MIN as i64 - 1,
        i64::MIN,
        i64::MAX,
    ];

    /// Lengths at the edge of each string, bin, array and map marker.
    pub(crate) const LENGTH_EDGES: [usize; 10] = [0, 1, 15, 16, 31, 32, 255, 256, 65_535, 65_536];

    /// Calls `$check` with every edge value: each integer edge in every
    /// integer type it fits, each length edge as a string (of one- and
    /// two-byte characters), bytes, an array and a map. Both codecs' tests
    /// walk the same values; the call site needs the edge constants,
    /// `BTreeMap` and `serde_bytes` in scope.
    macro_rules! each_edge_value {
        ($check:ident) => {
            for n in UNSIGNED_EDGES.iter().copied() {
                $check(&n);
                if let Ok(n) = u32::try_from(n) {
                    $check(&n);
                }
                if let Ok(n) = u16::try_from(n) {
                    $check(&n);
                }
                if let Ok(n) = u8::try_from(n) {
                    $check(&n);
                }
                if let Ok(n) = i64::try_from(n) {
                    $check(&n);
                }
            }
            for n in SIGNED_EDGES.iter().copied() {
                $check(&n);
                if let Ok(n) = i32::try_from(n) {
                    $check(&n);
                }
                if let Ok(n) = i16::try_from(n) {
                    $check(&n);
                }
                if let Ok(n) = i8::try_from(n) {
                    $check(&n);
                }
            }
            for len in LENGTH_EDGES.iter().copied() {
                $check(&"é".repeat(len / 2 + len % 2));
                $check(&"x".repeat(len));
                $check(&serde_bytes::ByteBuf::from(vec![7u8; len]));
                $check(&(0..len as u32).collect::<Vec<_>>());
                $check(
                    &(0..len as u32)
                        .map(|i| (i, i + 1))
                        .collect::<BTreeMap<_, _>>(),
                );
            }
        };
    }
    pub(crate) use each_edge_value;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Unit;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    enum Shape {
        Bare,
        New(u32),
        Tuple(i8, String),
        Fields {
            maybe: Option<u64>,
            #[serde(with = "serde_bytes")]
            bytes: Vec<u8>,
            inner: Box<Option<Shape>>,
        },
    }

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Mixed {
        flag: bool,
        single: f32,
        double: f64,
        letter: char,
        unit: Unit,
        shapes: Vec<Shape>,
        absent: Option<Shape>,
    }

    #[test]
    fn every_marker_and_shape_reads_as_rmp_serde_reads_it() {
        each_edge_value!(both);
        both(&Mixed {
            flag: true,
            single: 1.5,
            double: -0.25,
            letter: 'ß',
            unit: Unit,
            shapes: vec![
                Shape::Bare,
                Shape::New(70_000),
                Shape::Tuple(-5, "t".into()),
                Shape::Fields {
                    maybe: None,
                    bytes: vec![1, 2, 3],
                    inner: Box::new(Some(Shape::Fields {
                        maybe: Some(9),
                        bytes: vec![],
                        inner: Box::new(Some(Shape::Bare)),
                    })),
                },
            ],
            absent: None,
        });
        both(&Some(Shape::New(3)));
        both(&(Unit, (), Some(Unit), [1u8, 2, 3]));
    }

    #[test]
    fn what_it_does_not_read_as_rmp_serde_does_is_refused() {
        // Invalid UTF-8 in a string (rmp-serde offers it as bytes), a byte
        // string where a sequence is asked for, trailing bytes, nesting
        // past the limit, and a truncated body.
        assert!(from_slice::<String>(&[0xa2, 0xff, 0xfe]).is_err());
        assert!(from_slice::<Vec<u8>>(&[0xc4, 0x01, 0x07]).is_err());
        assert!(from_slice::<u32>(&[0x01, 0x02]).is_err());
        let mut deep = vec![0x91; SLICE_DEPTH_MAX as usize + 1];
        deep.push(0xc0);
        assert!(from_slice::<serde::de::IgnoredAny>(&deep).is_err());
        assert!(from_slice::<serde::de::IgnoredAny>(&deep[1..]).is_ok());
        assert!(from_slice::<String>(&[0xa3, b'a']).is_err());
        // 128-bit numbers, extension types, a unit variant whose body is
        // not nil, an enum map of two entries.
        assert!(from_slice::<i128>(&[0x01]).is_err());
        assert!(from_slice::<serde::de::IgnoredAny>(&[0xd4, 0x01, 0x02]).is_err());
        assert!(from_slice::<Shape>(&[0x81, 0xa4, b'B', b'a', b'r', b'e', 0x01]).is_err());
        let two = [
            0x82, 0xa3, b'N', b'e', b'w', 0x01, 0xa3, b'N', b'e', b'w', 0x02,
        ];
        assert!(from_slice::<Shape>(&two).is_err());
        assert!(rmp_serde::from_slice::<Shape>(&two).is_err());
    }

    /// A field that takes `None` on any error, as lenient types do.
    #[derive(Debug, PartialEq)]
    struct Lenient<T>(Option<T>);

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for Lenient<T> {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            Ok(Lenient(T::deserialize(d).ok()))
        }
    }

    #[test]
    fn a_refusal_the_decoded_type_catches_still_refuses_the_body() {
        // Goal: after a caught refusal the reader may stand elsewhere than
        // rmp-serde's, so the decode must go to rmp-serde. Method: a bin
        // where a sequence is asked for (rmp-serde reads it as numbers) and
        // invalid UTF-8 (rmp-serde hands it over as bytes), each inside a
        // lenient field.
        let bin_as_seq = [0x93, 0xc4, 0x01, 0x07];
        assert!(from_slice::<(Lenient<Vec<u8>>, u8, u8)>(&bin_as_seq).is_err());
        assert!(rmp_serde::from_slice::<(Lenient<Vec<u8>>, u8, u8)>(&bin_as_seq).is_err());
        let bad_utf8 = [0xa1, 0xff];
        assert!(from_slice::<Lenient<String>>(&bad_utf8).is_err());
        assert!(from_slice::<Lenient<serde_bytes::ByteBuf>>(&bad_utf8).is_err());
        assert_eq!(
            rmp_serde::from_slice::<Lenient<serde_bytes::ByteBuf>>(&bad_utf8).unwrap(),
            Lenient(Some(serde_bytes::ByteBuf::from(vec![0xff])))
        );
    }

    /// An expression tree: a recursive enum, decoded through
    /// `deserialize_enum`, which `rmp_serde` does not count in its depth.
    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    enum Expr {
        Lit(u8),
        Neg(Box<Expr>),
    }

    /// `Neg(Neg(...Lit(1)))`, `levels` deep, as rmp-serde writes it: each
    /// level a map of one entry, the variant's name to its data.
    fn negations(levels: usize) -> Vec<u8> {
        let mut body = Vec::with_capacity(levels * 5 + 8);
        for _ in 0..levels {
            body.extend_from_slice(&[0x81, 0xa3, b'N', b'e', b'g']);
        }
        body.extend_from_slice(&[0x81, 0xa3, b'L', b'i', b't', 0x01]);
        body
    }

    // Goal: the nesting walk counts what the general reader would recurse
    // into, and nothing else. Method: bodies of known depth built from
    // every container marker, with scalars, strings, byte strings and
    // extensions beside and inside them whose bytes look like containers.
    #[test]
    fn the_nesting_walk_counts_containers_only() {
        let arrays = |d: usize| {
            let mut b = vec![0x91; d - 1];
            b.push(0x90);
            b
        };
        // An empty innermost container is not recursed into.
        assert!(nests_within(&arrays(10), 9));
        assert!(!nests_within(&arrays(11), 9));
        let wide = |d: usize| {
            let mut b = Vec::new();
            for i in 0..d {
                match i % 4 {
                    0 => b.extend_from_slice(&[0xdc, 0, 1]),
                    1 => b.extend_from_slice(&[0xdd, 0, 0, 0, 1]),
                    2 => b.extend_from_slice(&[0xde, 0, 1, 0x01]),
                    _ => b.extend_from_slice(&[0xdf, 0, 0, 0, 1, 0x01]),
                }
            }
            b.push(0x07);
            b
        };
        assert!(nests_within(&wide(8), 8));
        assert!(!nests_within(&wide(9), 8));
        // Strings, byte strings, extensions and numbers whose bytes are
        // container markers are skipped whole.
        let mut flat = vec![0x9a];
        flat.extend_from_slice(&[0xa3, 0x91, 0x91, 0x91]);
        flat.extend_from_slice(&[0xc4, 3, 0x91, 0x91, 0x91]);
        flat.extend_from_slice(&[0xd9, 2, 0x81, 0x81]);
        flat.extend_from_slice(&[0xc5, 0, 2, 0x91, 0x91]);
        flat.extend_from_slice(&[0xd6, 1, 0x91, 0x91, 0x91, 0x91]);
        flat.extend_from_slice(&[0xc7, 2, 5, 0x91, 0x91]);
        flat.extend_from_slice(&[0xcd, 0x91, 0x91]);
        flat.extend_from_slice(&[0xcb, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91]);
        flat.extend_from_slice(&[0xd4, 1, 0x91]);
        flat.extend_from_slice(&[0x91, 0x90]);
        assert!(nests_within(&flat, 2));
        assert!(!nests_within(&flat, 1));
        // Every other scalar, string and extension marker, skipped whole,
        // then a map whose key is a container; and a map of two entries
        // whose last value nests.
        let mut rest = vec![0xdc, 0, 25];
        rest.extend_from_slice(&[0xc6, 0, 0, 0, 2, 0x91, 0x91]);
        rest.extend_from_slice(&[0xda, 0, 1, 0x91]);
        rest.extend_from_slice(&[0xdb, 0, 0, 0, 1, 0x91]);
        rest.extend_from_slice(&[0xc8, 0, 1, 9, 0x91]);
        rest.extend_from_slice(&[0xc9, 0, 0, 0, 1, 9, 0x91]);
        rest.extend_from_slice(&[0xd5, 1, 0x91, 0x91]);
        rest.extend_from_slice(&[0xd7, 1, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91]);
        rest.push(0xd8);
        rest.extend_from_slice(&[1; 17]);
        rest.extend_from_slice(&[0xca, 0x91, 0x91, 0x91, 0x91]);
        rest.extend_from_slice(&[0xcc, 0x91]);
        rest.extend_from_slice(&[0xce, 0x91, 0x91, 0x91, 0x91]);
        rest.extend_from_slice(&[0xcf, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91]);
        rest.extend_from_slice(&[0xd0, 0x91]);
        rest.extend_from_slice(&[0xd1, 0x91, 0x91]);
        rest.extend_from_slice(&[0xd2, 0x91, 0x91, 0x91, 0x91]);
        rest.extend_from_slice(&[0xd3, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91]);
        rest.extend_from_slice(&[0xc0, 0xc1, 0xc2, 0xc3, 0xe0, 0xff, 0x7f]);
        // The 24th item: a map whose key is an array of an array.
        rest.extend_from_slice(&[0x81, 0x91, 0x91, 0x01, 0x02]);
        // The 25th: two entries, the last value an array of an array.
        rest.extend_from_slice(&[0x82, 0x01, 0x02, 0x03, 0x91, 0x91, 0x04]);
        assert!(nests_within(&rest[..rest.len() - 1], 4), "cut short");
        assert!(nests_within(&rest, 4));
        assert!(!nests_within(&rest, 3));
        // A body cut short is judged on what it holds.
        assert!(nests_within(&arrays(2000)[..100], 100));
        assert!(!nests_within(&arrays(2000)[..1500], 1024));
        assert!(nests_within(&[], 0));
        assert!(!nests_within(&[0x91, 0x01], 0));
        // Enum variants with data count, one level each.
        assert!(nests_within(&negations(99), 100));
        assert!(!nests_within(&negations(100), 100));
    }

    // Goal: a payload or record body nested deeper than the limit is
    // refused with a typed error instead of overflowing the stack (which
    // aborts the process), and one at the limit still decodes. Method: a
    // recursive enum 200,000 levels deep (a megabyte, the payload limit)
    // decoded as a payload and as a record body, on a thread with the
    // default 2 MiB stack; without the nesting walk this test dies of a
    // stack overflow. Then one level past the limit, refused the same way,
    // and one at it, decoded.
    #[test]
    fn a_body_nested_past_the_limit_is_refused_not_a_stack_overflow() {
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| {
                let deep = negations(200_000);
                assert!(deep.len() <= crate::PAYLOAD_BYTES_MAX);
                let payload = crate::Payload::from_bytes(deep.clone());
                assert!(matches!(
                    payload.decode::<Expr>(),
                    Err(rmp_serde::decode::Error::DepthLimitExceeded)
                ));
                match crate::codec::decode_body::<Expr>(&deep) {
                    Err(crate::codec::Error::Body(why)) => assert!(why.contains("nested deeper")),
                    other => panic!("a body too deep decoded as {other:?}"),
                }
                let past = crate::Payload::from_bytes(negations(BODY_NESTING_MAX as usize));
                assert!(past.nests_too_deep());
                assert!(past.decode::<Expr>().is_err());
                let levels = BODY_NESTING_MAX as usize - 1;
                let mut expected = Expr::Lit(1);
                for _ in 0..levels {
                    expected = Expr::Neg(Box::new(expected));
                }
                let body = negations(levels);
                assert_eq!(body, rmp_serde::to_vec(&expected).unwrap());
                let payload = crate::Payload::from_bytes(body.clone());
                assert!(!payload.nests_too_deep());
                assert_eq!(payload.decode::<Expr>().unwrap(), expected);
                assert_eq!(crate::codec::decode_body::<Expr>(&body).unwrap(), expected);
            })
            .unwrap()
            .join()
            .expect("decoding on a 2 MiB stack");
    }

    /// A key that takes strings only (as `serde_json::Value`'s map keys do).
    #[derive(PartialEq, Eq, PartialOrd, Ord, Debug, Serialize)]
    struct StrOnly(String);

    impl<'de> Deserialize<'de> for StrOnly {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            struct V;
            impl<'de> de::Visitor<'de> for V {
                type Value = StrOnly;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a string")
                }
                fn visit_str<E: de::Error>(self, s: &str) -> std::result::Result<StrOnly, E> {
                    Ok(StrOnly(s.to_string()))
                }
            }
            d.deserialize_str(V)
        }
    }

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Flattened {
        known: u32,
        #[serde(flatten)]
        rest: Option<BTreeMap<StrOnly, u32>>,
    }

    #[test]
    fn a_users_flattened_fields_read_as_rmp_serde_reads_them() {
        // Goal: a payload's type that flattens unknown fields into keys
        // taking strings only decodes as rmp-serde decodes it. Handed over
        // as bytes, the unknown names would fail as keys, and the `Option`
        // would swallow that into `None` with no error to fall back on:
        // payloads are read with names as strings. Method: both readers on
        // the type encoded with field names.
        let value = Flattened {
            known: 1,
            rest: Some(BTreeMap::from([(StrOnly("extra".into()), 2)])),
        };
        let body = rmp_serde::to_vec_named(&value).unwrap();
        let slow: Flattened = rmp_serde::from_slice(&body).unwrap();
        assert_eq!(slow, value);
        assert_eq!(from_slice::<Flattened>(&body).ok(), Some(value));
    }
}
