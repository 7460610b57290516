//! keel's own msgpack writer: the bytes `rmp_serde::encode::write`
//! produces for keel's positional records, and `rmp_serde::to_vec_named`
//! for payloads, written straight into the vector.
//!
//! Why: every event a shard commits and every run record and task row the
//! store's writer derives is encoded once, and rmp-serde's writer goes
//! through `std::io::Write` and a typed error at every marker, about 1,750
//! instructions for an average 76-byte event. Writing the same markers with
//! `Vec::push` does the same work without those layers.
//!
//! The bytes must be exactly rmp-serde's, since the stored records and the
//! golden files are: the smallest integer form (a non-negative signed
//! integer as an unsigned one), `f32` and `f64` always in full, structs as
//! arrays of their fields, unit variants as their name, other variants as a
//! one-entry map from their name, newtypes as their inner value, `i128` and
//! `u128` as 16 big-endian bytes, and a sequence or map of unknown length
//! counted and then written. Written with names ([`write_named`], as
//! payloads are), a struct is a map from each field's name to its value
//! instead. The one shape left to rmp-serde is its `Ext`
//! newtype, which no keel record uses: [`write`] refuses it with
//! [`Unsupported`], as it refuses anything a `Serialize` impl fails on, and
//! the caller hands the value to rmp-serde, whose error or bytes then stand.

use std::fmt;

use serde::ser::{self, Serialize};

/// A value [`write`] leaves to rmp-serde's writer.
#[derive(Debug)]
pub(crate) struct Unsupported;

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("left to rmp-serde's writer")
    }
}

impl std::error::Error for Unsupported {}

impl ser::Error for Unsupported {
    fn custom<T: fmt::Display>(_msg: T) -> Self {
        Unsupported
    }
}

type Result<T = ()> = std::result::Result<T, Unsupported>;

/// The name rmp-serde gives its `Ext` newtype.
const EXT_STRUCT_NAME: &str = "_ExtStruct";

/// Appends `value` to `out` as rmp-serde's positional writer would. On
/// [`Unsupported`], `out` may hold part of the value: the caller truncates.
pub(crate) fn write<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result {
    value.serialize(&mut Writer { out, named: false })
}

/// Appends `value` to `out` as `rmp_serde::to_vec_named` would: structs as
/// maps keyed by field name. On [`Unsupported`], as [`write`].
pub(crate) fn write_named<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result {
    value.serialize(&mut Writer { out, named: true })
}

struct Writer<'a> {
    out: &'a mut Vec<u8>,
    /// Structs as maps keyed by field name, not arrays.
    named: bool,
}

impl Writer<'_> {
    /// A length's marker: the fixed form up to `fix_max`, then the 8-bit
    /// form where the type has one (strings), then 16 and 32 bits.
    #[inline(always)]
    fn marker_with_len(&mut self, len: usize, fix: u8, fix_max: usize, m8: Option<u8>, m16: u8) {
        if len <= fix_max {
            self.out.push(fix | len as u8);
        } else if let Some(m8) = m8.filter(|_| len <= u8::MAX as usize) {
            self.out.extend_from_slice(&[m8, len as u8]);
        } else if len <= u16::MAX as usize {
            self.out.push(m16);
            self.out.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            // The 32-bit form's marker follows the 16-bit one's.
            self.out.push(m16 + 1);
            self.out.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }

    #[inline(always)]
    fn array_len(&mut self, len: usize) -> Result {
        if len > u32::MAX as usize {
            return Err(Unsupported);
        }
        self.marker_with_len(len, 0x90, 15, None, 0xdc);
        Ok(())
    }

    /// A struct's header: its fields' count, as an array or a map.
    #[inline(always)]
    fn struct_len(&mut self, len: usize) -> Result {
        if self.named {
            self.map_len(len)
        } else {
            self.array_len(len)
        }
    }

    #[inline(always)]
    fn map_len(&mut self, len: usize) -> Result {
        if len > u32::MAX as usize {
            return Err(Unsupported);
        }
        self.marker_with_len(len, 0x80, 15, None, 0xde);
        Ok(())
    }

    #[inline(always)]
    fn str(&mut self, v: &str) -> Result {
        if v.len() > u32::MAX as usize {
            return Err(Unsupported);
        }
        self.marker_with_len(v.len(), 0xa0, 31, Some(0xd9), 0xda);
        self.out.extend_from_slice(v.as_bytes());
        Ok(())
    }

    #[inline(always)]
    fn uint(&mut self, v: u64) {
        if v < 128 {
            self.out.push(v as u8);
        } else if v <= u8::MAX as u64 {
            self.out.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u16::MAX as u64 {
            self.out.push(0xcd);
            self.out.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u32::MAX as u64 {
            self.out.push(0xce);
            self.out.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.out.push(0xcf);
            self.out.extend_from_slice(&v.to_be_bytes());
        }
    }

    #[inline(always)]
    fn sint(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.out.push(v as i8 as u8);
        } else if v >= i8::MIN as i64 {
            self.out.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i16::MIN as i64 {
            self.out.push(0xd1);
            self.out.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i32::MIN as i64 {
            self.out.push(0xd2);
            self.out.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.out.push(0xd3);
            self.out.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// The one-entry map that opens a variant with data.
    #[inline(always)]
    fn variant(&mut self, variant: &str) -> Result {
        self.out.push(0x81);
        self.str(variant)
    }
}

/// A sequence or map whose length serde did not know: its items are
/// written to a buffer and counted, and the header goes before them at
/// the end, as rmp-serde does.
struct Counted<'w, 'a> {
    writer: &'w mut Writer<'a>,
    map: bool,
    items: Vec<u8>,
    count: usize,
}

/// What a compound value writes into: straight through when its length
/// was known, counted otherwise.
enum Compound<'w, 'a> {
    Known(&'w mut Writer<'a>),
    Counted(Counted<'w, 'a>),
}

impl Compound<'_, '_> {
    #[inline(always)]
    fn item<T: Serialize + ?Sized>(&mut self, value: &T) -> Result {
        match self {
            Compound::Known(w) => value.serialize(&mut **w),
            Compound::Counted(c) => {
                c.count += 1;
                let named = c.writer.named;
                value.serialize(&mut Writer {
                    out: &mut c.items,
                    named,
                })
            }
        }
    }

    /// A struct's field: its name first when written with names. A struct
    /// always knows its length, so it is never counted.
    #[inline(always)]
    fn field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result {
        match self {
            Compound::Known(w) => {
                if w.named {
                    w.str(key)?;
                }
                value.serialize(&mut **w)
            }
            Compound::Counted(_) => Err(Unsupported),
        }
    }

    #[inline(always)]
    fn finish(self) -> Result {
        if let Compound::Counted(c) = self {
            if c.map {
                c.writer.map_len(c.count / 2)?;
            } else {
                c.writer.array_len(c.count)?;
            }
            c.writer.out.extend_from_slice(&c.items);
        }
        Ok(())
    }
}

impl<'w, 'a> ser::Serializer for &'w mut Writer<'a> {
    type Ok = ();
    type Error = Unsupported;
    type SerializeSeq = Compound<'w, 'a>;
    type SerializeTuple = Compound<'w, 'a>;
    type SerializeTupleStruct = Compound<'w, 'a>;
    type SerializeTupleVariant = Compound<'w, 'a>;
    type SerializeMap = Compound<'w, 'a>;
    type SerializeStruct = Compound<'w, 'a>;
    type SerializeStructVariant = Compound<'w, 'a>;

    fn is_human_readable(&self) -> bool {
        false
    }

    #[inline]
    fn serialize_bool(self, v: bool) -> Result {
        self.out.push(if v { 0xc3 } else { 0xc2 });
        Ok(())
    }

    #[inline]
    fn serialize_i8(self, v: i8) -> Result {
        self.sint(v.into());
        Ok(())
    }

    #[inline]
    fn serialize_i16(self, v: i16) -> Result {
        self.sint(v.into());
        Ok(())
    }

    #[inline]
    fn serialize_i32(self, v: i32) -> Result {
        self.sint(v.into());
        Ok(())
    }

    #[inline]
    fn serialize_i64(self, v: i64) -> Result {
        self.sint(v);
        Ok(())
    }

    fn serialize_i128(self, v: i128) -> Result {
        self.serialize_bytes(&v.to_be_bytes())
    }

    #[inline]
    fn serialize_u8(self, v: u8) -> Result {
        self.uint(v.into());
        Ok(())
    }

    #[inline]
    fn serialize_u16(self, v: u16) -> Result {
        self.uint(v.into());
        Ok(())
    }

    #[inline]
    fn serialize_u32(self, v: u32) -> Result {
        self.uint(v.into());
        Ok(())
    }

    #[inline]
    fn serialize_u64(self, v: u64) -> Result {
        self.uint(v);
        Ok(())
    }

    fn serialize_u128(self, v: u128) -> Result {
        self.serialize_bytes(&v.to_be_bytes())
    }

    fn serialize_f32(self, v: f32) -> Result {
        self.out.push(0xca);
        self.out.extend_from_slice(&v.to_bits().to_be_bytes());
        Ok(())
    }

    fn serialize_f64(self, v: f64) -> Result {
        self.out.push(0xcb);
        self.out.extend_from_slice(&v.to_bits().to_be_bytes());
        Ok(())
    }

    fn serialize_char(self, v: char) -> Result {
        self.str(v.encode_utf8(&mut [0; 4]))
    }

    #[inline]
    fn serialize_str(self, v: &str) -> Result {
        self.str(v)
    }

    #[inline]
    fn serialize_bytes(self, v: &[u8]) -> Result {
        if v.len() > u32::MAX as usize {
            return Err(Unsupported);
        }
        // bin 8, 16 and 32: unlike strings, no fixed form.
        let len = v.len();
        if len <= u8::MAX as usize {
            self.out.extend_from_slice(&[0xc4, len as u8]);
        } else if len <= u16::MAX as usize {
            self.out.push(0xc5);
            self.out.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.out.push(0xc6);
            self.out.extend_from_slice(&(len as u32).to_be_bytes());
        }
        self.out.extend_from_slice(v);
        Ok(())
    }

    #[inline]
    fn serialize_none(self) -> Result {
        self.out.push(0xc0);
        Ok(())
    }

    #[inline]
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result {
        value.serialize(self)
    }

    fn serialize_unit(self) -> Result {
        self.out.push(0xc0);
        Ok(())
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result {
        self.out.push(0x90);
        Ok(())
    }

    #[inline]
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result {
        self.str(variant)
    }

    #[inline]
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        value: &T,
    ) -> Result {
        if name == EXT_STRUCT_NAME {
            return Err(Unsupported);
        }
        value.serialize(self)
    }

    #[inline]
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result {
        self.variant(variant)?;
        value.serialize(self)
    }

    #[inline]
    fn serialize_seq(self, len: Option<usize>) -> Result<Compound<'w, 'a>> {
        match len {
            Some(len) => {
                self.array_len(len)?;
                Ok(Compound::Known(self))
            }
            None => Ok(Compound::Counted(Counted {
                writer: self,
                map: false,
                items: Vec::with_capacity(128),
                count: 0,
            })),
        }
    }

    #[inline]
    fn serialize_tuple(self, len: usize) -> Result<Compound<'w, 'a>> {
        self.array_len(len)?;
        Ok(Compound::Known(self))
    }

    #[inline]
    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> Result<Compound<'w, 'a>> {
        self.array_len(len)?;
        Ok(Compound::Known(self))
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Compound<'w, 'a>> {
        self.variant(variant)?;
        self.array_len(len)?;
        Ok(Compound::Known(self))
    }

    #[inline]
    fn serialize_map(self, len: Option<usize>) -> Result<Compound<'w, 'a>> {
        match len {
            Some(len) => {
                self.map_len(len)?;
                Ok(Compound::Known(self))
            }
            None => Ok(Compound::Counted(Counted {
                writer: self,
                map: true,
                items: Vec::with_capacity(128),
                count: 0,
            })),
        }
    }

    #[inline]
    fn serialize_struct(self, _name: &'static str, len: usize) -> Result<Compound<'w, 'a>> {
        self.struct_len(len)?;
        Ok(Compound::Known(self))
    }

    #[inline]
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Compound<'w, 'a>> {
        self.variant(variant)?;
        self.struct_len(len)?;
        Ok(Compound::Known(self))
    }
}

/// The compound traits whose items are all written alike: `$method`
/// takes each item (after a field's name, where the trait has one) and
/// `end` writes a counted header if the length was not known.
macro_rules! compound {
    ($($trait:ident :: $method:ident ($($key:ident)?) => $how:ident;)*) => {$(
        impl ser::$trait for Compound<'_, '_> {
            type Ok = ();
            type Error = Unsupported;

            #[inline]
            fn $method<T: Serialize + ?Sized>(
                &mut self,
                $($key: &'static str,)?
                value: &T,
            ) -> Result {
                compound!(@call self $how ($($key)?) value)
            }

            #[inline]
            fn end(self) -> Result {
                self.finish()
            }
        }
    )*};
    (@call $self:ident item () $value:ident) => { $self.item($value) };
    (@call $self:ident field ($key:ident) $value:ident) => { $self.field($key, $value) };
}

compound! {
    SerializeSeq::serialize_element() => item;
    SerializeTuple::serialize_element() => item;
    SerializeTupleStruct::serialize_field() => item;
    SerializeTupleVariant::serialize_field() => item;
    SerializeStruct::serialize_field(key) => field;
    SerializeStructVariant::serialize_field(key) => field;
}

impl ser::SerializeMap for Compound<'_, '_> {
    type Ok = ();
    type Error = Unsupported;

    #[inline]
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result {
        self.item(key)
    }

    #[inline]
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result {
        self.item(value)
    }

    #[inline]
    fn end(self) -> Result {
        self.finish()
    }
}

#[cfg(test)]
mod tests {
    // Goal: the writer produces rmp-serde's positional bytes for every
    // msgpack marker and every serde shape, so a record written by either
    // is the same record; a different byte would change stored records and
    // the golden files.
    // Method: values at the edges of each marker (fixint to 64-bit, fixstr
    // to str32, bin8 to bin32, fixarray to array32, fixmap to map32),
    // enums of every variant shape, options, unit structs, 128-bit numbers,
    // floats, and sequences and maps whose length serde does not know;
    // each written by both writers and compared byte for byte.
    use super::*;
    use crate::slice_de::tests::{each_edge_value, LENGTH_EDGES, SIGNED_EDGES, UNSIGNED_EDGES};
    use serde::ser::{SerializeMap, SerializeSeq, Serializer as _};
    use serde::Serialize;
    use std::collections::BTreeMap;
    use std::fmt::Debug;

    fn same<T: Serialize + Debug + ?Sized>(value: &T) {
        let expected = rmp_serde::to_vec(value).unwrap();
        let mut out = Vec::new();
        write(&mut out, value).unwrap_or_else(|_| panic!("refused {value:?}"));
        assert_eq!(out, expected, "{value:?}");
        let expected = rmp_serde::to_vec_named(value).unwrap();
        let mut out = Vec::new();
        write_named(&mut out, value).unwrap_or_else(|_| panic!("named: refused {value:?}"));
        assert_eq!(out, expected, "named: {value:?}");
    }

    #[derive(Serialize, Debug)]
    struct Unit;

    #[derive(Serialize, Debug)]
    struct Wrapper(u64);

    #[derive(Serialize, Debug)]
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

    #[derive(Serialize, Debug)]
    struct Mixed {
        flag: bool,
        off: bool,
        single: f32,
        double: f64,
        letter: char,
        unit: Unit,
        nothing: (),
        wrapped: Wrapper,
        big: i128,
        bigger: u128,
        shapes: Vec<Shape>,
        absent: Option<Shape>,
    }

    /// A struct serde writes as a map of unknown length.
    #[derive(Serialize, Debug)]
    struct Flattened {
        id: u32,
        #[serde(flatten)]
        extra: BTreeMap<String, Shape>,
    }

    #[derive(Serialize, Debug)]
    struct Pair {
        left: u8,
        right: String,
    }

    /// A sequence of unknown length whose items are structs.
    #[derive(Debug)]
    struct Structs(u32);

    impl Serialize for Structs {
        fn serialize<S: ser::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
            let mut q = s.serialize_seq(None)?;
            for i in 0..self.0 {
                q.serialize_element(&Wrapper(i.into()))?;
                q.serialize_element(&Pair {
                    left: i as u8,
                    right: "r".into(),
                })?;
                q.serialize_element(&Shape::Fields {
                    maybe: None,
                    bytes: vec![i as u8],
                    inner: Box::new(Some(Shape::Bare)),
                })?;
            }
            q.end()
        }
    }

    /// A sequence or map whose iterator does not say its length.
    #[derive(Debug)]
    struct Unsized(u32, bool);

    impl Serialize for Unsized {
        fn serialize<S: ser::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
            if self.1 {
                let mut m = s.serialize_map(None)?;
                for i in 0..self.0 {
                    m.serialize_entry(&i, &Unsized(i % 3, false))?;
                }
                m.end()
            } else {
                let mut q = s.serialize_seq(None)?;
                for i in 0..self.0 {
                    q.serialize_element(&i)?;
                }
                q.end()
            }
        }
    }

    #[test]
    fn every_marker_and_shape_is_written_as_rmp_serde_writes_it() {
        each_edge_value!(same);
        for len in LENGTH_EDGES.iter().copied() {
            same(&Unsized(len as u32, false));
            same(&Unsized(len.min(300) as u32, true));
        }
        same(&Mixed {
            flag: true,
            off: false,
            single: 1.5,
            double: -0.25,
            letter: 'ß',
            unit: Unit,
            nothing: (),
            wrapped: Wrapper(70_000),
            big: -7,
            bigger: u128::MAX - 1,
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
        same(&Some(Shape::New(3)));
        // Structs inside a map and a sequence of unknown length: written
        // with names there too when the writer is named.
        same(&Flattened {
            id: 7,
            extra: [
                ("a".to_string(), Shape::Bare),
                ("b".into(), Shape::New(1)),
                (
                    "c".into(),
                    Shape::Fields {
                        maybe: Some(1),
                        bytes: vec![9],
                        inner: Box::new(None),
                    },
                ),
            ]
            .into(),
        });
        same(&Structs(3));
        same(&(Unit, (), Some(Unit), [1u8, 2, 3], f64::NAN, f32::INFINITY));
    }

    #[test]
    fn what_it_leaves_to_rmp_serde_is_refused() {
        // rmp-serde's extension newtype, and any error a `Serialize` impl
        // raises: the caller hands both to rmp-serde.
        let mut out = Vec::new();
        let ext = (&mut Writer {
            out: &mut out,
            named: false,
        })
            .serialize_newtype_struct(EXT_STRUCT_NAME, &(1i8, [0u8; 2]));
        assert!(ext.is_err());

        struct Fails;
        impl Serialize for Fails {
            fn serialize<S: ser::Serializer>(&self, _: S) -> std::result::Result<S::Ok, S::Error> {
                Err(ser::Error::custom("no"))
            }
        }
        assert!(write(&mut Vec::new(), &vec![Fails]).is_err());
    }
}
