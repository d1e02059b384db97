//! A hand-written reader of a plain stream chunk: one pass over the bytes, no allocation, no
//! serde. It answers what [`super::chunk::read`] answers — content, text bytes, usage — for the
//! chunks servers send, and declines (`None`) anything it is not sure to read as serde does: a
//! key or an `object` with an escape, a field given twice, a field of an unexpected type, a
//! number with an exponent, nesting deeper than [`MAX_DEPTH`], a lone surrogate. A declined
//! chunk goes the typed way, so a decline costs only time; a differential property test holds
//! every answer to the typed reader's.
//!
//! The typed reader parses every key and skips every value through serde's visitor machinery:
//! for a 200-byte chunk that was most of a streamed event's cost in the gateway.

use super::Usage;
use super::chunk::Plain;

/// Deeper values are declined (serde_json's own limit is 128).
const MAX_DEPTH: u32 = 64;

/// The bytes of the word (little-endian) that are a `"`, a `\\` or a control character (below
/// 0x20), as their high bits: the bytes that end a string's plain run. Bit tricks as serde_json's
/// own `skip_to_escape` uses; the lowest bit set is exact (a borrow only runs upward from a
/// byte that matched), so it names the first such byte.
#[inline]
fn special(w: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero = |x: u64| x.wrapping_sub(ONES) & !x & HIGH;
    let quote = zero(w ^ (ONES * u64::from(b'"')));
    let slash = zero(w ^ (ONES * u64::from(b'\\')));
    let control = w.wrapping_sub(ONES * 0x20) & !w & HIGH;
    quote | slash | control
}

struct Cur<'a> {
    b: &'a [u8],
    i: usize,
    /// Where the strings a [`Skim`] lets vary lie, when a chunk is read to learn its shape.
    holes: Option<Vec<Hole>>,
}

/// What a string [`Hole`] stands for in the chunk's reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HoleKind {
    /// A choice's `delta.content` or `text`: its bytes are the text's, and content if not empty.
    Text,
    /// A delta's `refusal`, `reasoning_content` or `reasoning`: content if not empty.
    Flag,
    /// A string read by nothing (`obfuscation`, a tool call's `arguments`): any value will do.
    Opaque,
}

/// A string value of a learned chunk that the next chunks may change: from its opening quote to
/// after its closing one.
#[derive(Clone, Copy, Debug)]
struct Hole {
    start: usize,
    end: usize,
    len: usize,
    kind: HoleKind,
}

/// Keys whose string values no rule reads, wherever they are: a hole of their own, so a chunk
/// whose only change is there still matches its shape (OpenAI's `obfuscation` changes in
/// every chunk, a tool call's `arguments` in every piece of it).
const OPAQUE: [&[u8]; 2] = [b"obfuscation", b"arguments"];

/// A string's content: bytes once unescaped, and whether it held an escape.
#[derive(Clone, Copy)]
struct Str<'a> {
    raw: &'a [u8],
    len: usize,
    escaped: bool,
}

impl<'a> Cur<'a> {
    fn ws(&mut self) {
        while let Some(&c) = self.b.get(self.i) {
            if matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.i).copied()
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }

    fn lit(&mut self, word: &[u8]) -> Option<()> {
        self.b.get(self.i..self.i + word.len())?.eq(word).then(|| {
            self.i += word.len();
        })
    }

    /// A string (the cursor at its opening quote): its raw bytes and unescaped length. Plain
    /// runs are skipped eight bytes at a time (a word holds no quote, backslash or control
    /// character), the rest a byte at a time: a chunk's strings are mostly short keys.
    fn string(&mut self) -> Option<Str<'a>> {
        self.eat(b'"')?;
        let b = self.b;
        let start = self.i;
        let mut i = self.i;
        let mut len = 0usize;
        let mut escaped = false;
        // Where the current run of plain bytes began.
        let mut run = i;
        loop {
            // To the next byte that is not plain: eight at a time, the rest one by one.
            while let Some(w) = b.get(i..i + 8) {
                let m = special(u64::from_le_bytes(<[u8; 8]>::try_from(w).ok()?));
                if m != 0 {
                    i += (m.trailing_zeros() / 8) as usize;
                    break;
                }
                i += 8;
            }
            while let Some(&c) = b.get(i) {
                if c == b'"' || c == b'\\' || c < 0x20 {
                    break;
                }
                i += 1;
            }
            let c = *b.get(i)?;
            match c {
                b'"' => {
                    len += i - run;
                    self.i = i + 1;
                    return Some(Str {
                        raw: b.get(start..i)?,
                        len,
                        escaped,
                    });
                }
                b'\\' => {
                    len += i - run;
                    escaped = true;
                    self.i = i + 1;
                    len += self.escape()?;
                    i = self.i;
                    run = i;
                }
                // serde refuses control characters in strings.
                0..0x20 => return None,
                _ => i += 1,
            }
        }
    }

    /// An escape after its backslash: the bytes it stands for.
    fn escape(&mut self) -> Option<usize> {
        match *self.b.get(self.i)? {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                self.i += 1;
                Some(1)
            }
            b'u' => {
                self.i += 1;
                let cp = self.hex4()?;
                Some(match cp {
                    0..=0x7f => 1,
                    0x80..=0x7ff => 2,
                    0xd800..=0xdbff => {
                        // A high surrogate: only with its low half.
                        self.lit(b"\\u")?;
                        if !(0xdc00..=0xdfff).contains(&self.hex4()?) {
                            return None;
                        }
                        4
                    }
                    0xdc00..=0xdfff => return None,
                    _ => 3,
                })
            }
            _ => None,
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let h = self.b.get(self.i..self.i + 4)?;
        let mut v = 0u32;
        for &c in h {
            v = v << 4
                | match c {
                    b'0'..=b'9' => c - b'0',
                    b'a'..=b'f' => c - b'a' + 10,
                    b'A'..=b'F' => c - b'A' + 10,
                    _ => return None,
                } as u32;
        }
        self.i += 4;
        Some(v)
    }

    /// A number; `Some(Some(n))` for a plain non-negative integer that fits, `Some(None)` for
    /// any other number serde reads (a negative, a fraction, an integer past `u64`), `None` for
    /// what is not a number or has an exponent.
    fn number(&mut self) -> Option<Option<u64>> {
        self.ws();
        let neg = self.b.get(self.i) == Some(&b'-');
        if neg {
            self.i += 1;
        }
        let start = self.i;
        match *self.b.get(self.i)? {
            b'0' => self.i += 1,
            b'1'..=b'9' => {
                while self.b.get(self.i).is_some_and(u8::is_ascii_digit) {
                    self.i += 1;
                }
            }
            _ => return None,
        }
        let digits = &self.b[start..self.i];
        // serde reads a longer integer as a float, and refuses one past `f64`'s range.
        if digits.len() > 20 {
            return None;
        }
        let mut plain = !neg;
        if self.b.get(self.i) == Some(&b'.') {
            self.i += 1;
            let f = self.i;
            while self.b.get(self.i).is_some_and(u8::is_ascii_digit) {
                self.i += 1;
            }
            if self.i == f {
                return None;
            }
            plain = false;
        }
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) {
            return None;
        }
        if !plain {
            return Some(None);
        }
        let mut n = 0u64;
        for &d in digits {
            match n
                .checked_mul(10)
                .and_then(|n| n.checked_add(u64::from(d - b'0')))
            {
                Some(v) => n = v,
                None => return Some(None),
            }
        }
        Some(Some(n))
    }

    /// Any value, skipped (validated as serde would).
    fn skip(&mut self, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => self.string().map(drop),
            // An ignored object: its keys are read as the fields' are (an escaped one declines).
            b'{' => self.object(|c, key| c.value(key, depth + 1)),
            b'[' => {
                self.i += 1;
                self.items(|c| c.skip(depth + 1)).map(drop)
            }
            b't' => self.lit(b"true"),
            b'f' => self.lit(b"false"),
            b'n' => self.lit(b"null"),
            _ => self.number().map(drop),
        }
    }

    /// `null` (true) or not (false, the cursor unmoved).
    fn null(&mut self) -> Option<bool> {
        if self.peek()? == b'n' {
            self.lit(b"null")?;
            return Some(true);
        }
        Some(false)
    }

    /// An array's items after its `[`: each read by `item`; how many.
    fn items(&mut self, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<usize> {
        if self.eat(b']').is_some() {
            return Some(0);
        }
        let mut n = 0;
        loop {
            item(self)?;
            n += 1;
            match self.peek()? {
                b',' => self.i += 1,
                b']' => {
                    self.i += 1;
                    return Some(n);
                }
                _ => return None,
            }
        }
    }

    /// An object's fields (the cursor at its `{`): each key (no escapes, else declined) handed
    /// to `field`, which reads its value.
    fn object(&mut self, mut field: impl FnMut(&mut Self, &[u8]) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        if self.eat(b'}').is_some() {
            return Some(());
        }
        loop {
            if self.peek()? != b'"' {
                return None;
            }
            let key = self.string()?;
            if key.escaped {
                return None;
            }
            self.eat(b':')?;
            field(self, key.raw)?;
            match self.peek()? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A string or `null` (`Some(None)`); anything else declined.
    fn opt_str(&mut self) -> Option<Option<Str<'a>>> {
        if self.null()? {
            return Some(None);
        }
        if self.peek()? != b'"' {
            return None;
        }
        self.string().map(Some)
    }

    /// [`Cur::opt_str`], the string noted as a hole of `kind` when learning a shape.
    fn hole_str(&mut self, kind: HoleKind) -> Option<Option<Str<'a>>> {
        // Past any space: a string's hole starts at its quote.
        self.peek()?;
        let start = self.i;
        let s = self.opt_str()?;
        if let (Some(s), Some(holes)) = (s, self.holes.as_mut()) {
            holes.push(Hole {
                start,
                end: self.i,
                len: s.len,
                kind,
            });
        }
        Some(s)
    }

    /// A value no rule reads, skipped; a string under an [`OPAQUE`] key is a hole when
    /// learning a shape.
    fn value(&mut self, key: &[u8], depth: u32) -> Option<()> {
        // As deep as `skip` declines, whatever the value.
        if depth > MAX_DEPTH {
            return None;
        }
        if self.holes.is_some() && OPAQUE.contains(&key) && self.peek()? == b'"' {
            return self.hole_str(HoleKind::Opaque).map(drop);
        }
        self.skip(depth)
    }
}

/// Sets a field's seen flag; a field given twice is declined (serde refuses it).
fn once(seen: &mut bool) -> Option<()> {
    if std::mem::replace(seen, true) {
        None
    } else {
        Some(())
    }
}

#[derive(Default)]
struct ChoiceRead {
    content: bool,
    /// Content from what no hole can change: a finish reason, tool calls, a function call.
    fixed: bool,
    text_bytes: usize,
    finish: Option<&'static str>,
}

fn choice(c: &mut Cur<'_>) -> Option<ChoiceRead> {
    let mut out = ChoiceRead::default();
    let (mut fr, mut text, mut delta) = (false, false, false);
    c.object(|c, key| match key {
        b"finish_reason" => {
            once(&mut fr)?;
            if !c.null()? {
                out.finish = Some(if c.peek()? == b'"' {
                    // Compared as written: an escaped one is serde's to unescape.
                    let s = c.string()?;
                    if s.escaped {
                        return None;
                    }
                    super::trace::finish_name(s.raw)
                } else {
                    c.skip(3)?;
                    "other"
                });
                out.content = true;
                out.fixed = true;
            }
            Some(())
        }
        b"text" => {
            once(&mut text)?;
            if let Some(s) = c.hole_str(HoleKind::Text)? {
                out.text_bytes += s.len;
                out.content |= s.len > 0;
            }
            Some(())
        }
        b"delta" => {
            once(&mut delta)?;
            if c.null()? {
                return Some(());
            }
            if c.peek()? != b'{' {
                return None;
            }
            let (content, fixed, bytes) = delta_of(c)?;
            out.content |= content;
            out.fixed |= fixed;
            out.text_bytes += bytes;
            Some(())
        }
        _ => c.value(key, 3),
    })?;
    Some(out)
}

/// A delta object: whether it carries content, whether from what no hole can change, and its
/// `content`'s bytes.
fn delta_of(c: &mut Cur<'_>) -> Option<(bool, bool, usize)> {
    let (mut content, mut fixed, mut bytes) = (false, false, 0usize);
    let mut seen = [false; 6];
    c.object(|c, key| {
        let slot = match key {
            b"content" => 0,
            b"refusal" => 1,
            b"reasoning_content" => 2,
            b"reasoning" => 3,
            b"tool_calls" => 4,
            b"function_call" => 5,
            _ => return c.value(key, 4),
        };
        once(&mut seen[slot])?;
        match slot {
            0..=3 => {
                let kind = if slot == 0 {
                    HoleKind::Text
                } else {
                    HoleKind::Flag
                };
                if let Some(s) = c.hole_str(kind)? {
                    content |= s.len > 0;
                    if slot == 0 {
                        bytes = s.len;
                    }
                }
            }
            4 => {
                if !c.null()? {
                    if c.peek()? != b'[' {
                        return None;
                    }
                    c.i += 1;
                    let calls = c.items(|c| c.skip(5))? > 0;
                    content |= calls;
                    fixed |= calls;
                }
            }
            _ => {
                if !c.null()? {
                    c.skip(4)?;
                    content = true;
                    fixed = true;
                }
            }
        }
        Some(())
    })?;
    Some((content, fixed, bytes))
}

fn usage_of(c: &mut Cur<'_>) -> Option<Usage> {
    let (mut prompt, mut completion) = (None, None);
    let (mut sp, mut sc) = (false, false);
    c.object(|c, key| {
        let (seen, slot) = match key {
            b"prompt_tokens" => (&mut sp, &mut prompt),
            b"completion_tokens" => (&mut sc, &mut completion),
            _ => return c.skip(2),
        };
        once(seen)?;
        if !c.null()? {
            *slot = c.number()?;
        }
        Some(())
    })?;
    Some(Usage {
        prompt: prompt.unwrap_or(0),
        completion: completion.unwrap_or(0),
    })
}

/// The most of a chunk a [`Skim`] keeps as its shape; a longer chunk is read in full.
const MAX_SHAPE: usize = 8 * 1024;

/// A stream's chunks read against the last one read in full. A server sends hundreds of chunks
/// a stream that differ only in the strings it generates (`delta.content`, `obfuscation`, a
/// tool call's `arguments`): the bytes around those strings are compared with the last chunk
/// [`read`] accepted, and only the strings are read. Where every other byte is equal, every
/// key, number and structure is, so the reading is the last chunk's but for what the strings
/// give: their text bytes and whether they make it content. Anything else — a byte that
/// differs outside those strings, a string that does not end where JSON says, an escape that
/// is not valid — is read in full by [`read`], whose shape is kept for the next.
#[derive(Debug, Default)]
pub struct Skim {
    /// The last chunk read in full, or empty.
    shape: Vec<u8>,
    holes: Vec<Hole>,
    /// Its reading's content without the holes, its usage and finish reason.
    fixed: bool,
    usage: Option<Usage>,
    finish: Option<&'static str>,
}

impl Skim {
    /// [`read`]'s answer for `data`, mostly without reading it whole.
    pub fn read(&mut self, data: &str) -> Option<Plain> {
        if !self.shape.is_empty()
            && let Some(p) = self.like(data.as_bytes())
        {
            return Some(p);
        }
        self.learn(data)
    }

    /// `data` against the shape: the reading if only its holes differ.
    pub(crate) fn like(&self, d: &[u8]) -> Option<Plain> {
        let t = &self.shape[..];
        let (mut at, mut from) = (0usize, 0usize);
        let mut plain = Plain {
            content: self.fixed,
            text_bytes: 0,
            usage: self.usage,
            finish: self.finish,
        };
        for h in &self.holes {
            let same = t.get(from..h.start)?;
            if d.get(at..at + same.len())? != same || d.get(at + same.len()) != Some(&b'"') {
                return None;
            }
            let mut c = Cur {
                b: d,
                i: at + same.len(),
                holes: None,
            };
            let s = c.string()?;
            match h.kind {
                HoleKind::Text => {
                    plain.text_bytes += s.len;
                    plain.content |= s.len > 0;
                }
                HoleKind::Flag => plain.content |= s.len > 0,
                HoleKind::Opaque => {}
            }
            at = c.i;
            from = h.end;
        }
        (d.get(at..)? == t.get(from..)?).then_some(plain)
    }

    /// `data` read in full; its shape kept when it was read in one pass and is not too long.
    fn learn(&mut self, data: &str) -> Option<Plain> {
        self.shape.clear();
        let mut holes = std::mem::take(&mut self.holes);
        holes.clear();
        let mut c = Cur {
            b: data.as_bytes(),
            i: 0,
            holes: (data.len() <= MAX_SHAPE).then_some(holes),
        };
        let read = read_in(&mut c);
        self.holes = c.holes.take().unwrap_or_default();
        let (plain, fixed) = read?;
        // The holes account for every text byte the reading found (else no shape is kept).
        let text: usize = self
            .holes
            .iter()
            .filter(|h| h.kind == HoleKind::Text)
            .map(|h| h.len)
            .sum();
        if data.len() <= MAX_SHAPE && text == plain.text_bytes {
            self.shape.extend_from_slice(data.as_bytes());
            self.fixed = fixed;
            self.usage = plain.usage;
            self.finish = plain.finish;
        }
        Some(plain)
    }
}

/// The chunk read in one pass, or `None` where the typed reader must decide (see the module).
pub fn read(data: &str) -> Option<Plain> {
    let mut c = Cur {
        b: data.as_bytes(),
        i: 0,
        holes: None,
    };
    read_in(&mut c).map(|(p, _)| p)
}

/// [`read`] on a cursor (which may be learning a shape); with whether the chunk is content by
/// what no hole can change.
fn read_in(c: &mut Cur<'_>) -> Option<(Plain, bool)> {
    let mut fixed = false;
    let mut plain = Plain {
        content: false,
        text_bytes: 0,
        usage: None,
        finish: None,
    };
    let mut seen = [false; 4];
    if c.peek()? != b'{' {
        return None;
    }
    c.object(|c, key| match key {
        b"error" => {
            once(&mut seen[0])?;
            // An error that is not `null` is the `Value` path's to read.
            c.null()?.then_some(())
        }
        b"object" => {
            once(&mut seen[1])?;
            match c.opt_str()? {
                Some(s) if s.escaped || s.raw == b"error" => None,
                _ => Some(()),
            }
        }
        b"choices" => {
            once(&mut seen[2])?;
            if c.null()? {
                return Some(());
            }
            c.eat(b'[')?;
            c.items(|c| {
                if c.peek()? != b'{' {
                    return None;
                }
                let ch = choice(c)?;
                plain.content |= ch.content;
                fixed |= ch.fixed;
                plain.text_bytes += ch.text_bytes;
                if ch.finish.is_some() {
                    plain.finish = ch.finish;
                }
                Some(())
            })
            .map(drop)
        }
        b"usage" => {
            once(&mut seen[3])?;
            if c.null()? {
                return Some(());
            }
            if c.peek()? != b'{' {
                return None;
            }
            plain.usage = Some(usage_of(c)?);
            Some(())
        }
        _ => c.value(key, 1),
    })?;
    c.ws();
    (c.i == c.b.len()).then_some((plain, fixed))
}
