//! An incremental Server-Sent Events parser: bytes in, complete events out, however the bytes
//! were split across reads. Handles `\n`, `\r\n` and `\r` line endings, multi-line `data:`,
//! comments, and a missing space after the colon.

/// One event: its `event:` name (if any) and its `data:` lines joined with `\n`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

#[derive(Debug, Default)]
pub struct SseParser {
    /// The start of a line the last push did not finish.
    line: Vec<u8>,
    event: Option<String>,
    /// The event's `data:` lines so far, joined with `\n`.
    data: String,
    has_data: bool,
    last_was_cr: bool,
}

/// A line longer than this is not SSE from an LLM server; refusing it bounds memory on garbage.
const MAX_LINE: usize = 4 * 1024 * 1024;

#[derive(Debug, PartialEq, Eq)]
pub struct SseError(pub String);

fn too_long() -> SseError {
    SseError("SSE line over 4 MiB".into())
}

/// A non-empty line's field and value (`None` for a comment), a missing space after the colon
/// allowed.
fn field_of(line: &[u8]) -> Result<Option<(&str, &str)>, SseError> {
    if line[0] == b':' {
        return Ok(None);
    }
    let text = std::str::from_utf8(line).map_err(|_| SseError("SSE line is not UTF-8".into()))?;
    Ok(Some(match text.find(':') {
        Some(i) => {
            let v = &text[i + 1..];
            (&text[..i], v.strip_prefix(' ').unwrap_or(v))
        }
        None => (text, ""),
    }))
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the events they completed. Lines are found with `memchr` and read
    /// where they lie; only the unfinished end of a push is copied, to be completed by the next.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        let mut out = Vec::new();
        let mut rest = bytes;
        // A `\r\n` split between two pushes. An empty push (a zero-length body frame) between
        // them changes nothing: the `\n` that follows still ends the `\r`'s line, not another.
        if self.last_was_cr && !rest.is_empty() {
            self.last_was_cr = false;
            if let Some(tail) = rest.strip_prefix(b"\n") {
                rest = tail;
            }
        }
        while let Some(i) = memchr::memchr2(b'\n', b'\r', rest) {
            let (head, end) = (&rest[..i], rest[i]);
            if self.line.is_empty() {
                if head.len() > MAX_LINE {
                    return Err(too_long());
                }
                self.line_done(head, &mut out)?;
            } else {
                if self.line.len() + head.len() > MAX_LINE {
                    return Err(too_long());
                }
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(head);
                self.line_done(&line, &mut out)?;
                // The buffer is kept for the next unfinished line.
                line.clear();
                self.line = line;
            }
            rest = &rest[i + 1..];
            if end == b'\r' {
                match rest.first() {
                    Some(b'\n') => rest = &rest[1..],
                    None => self.last_was_cr = true,
                    Some(_) => {}
                }
            }
        }
        if !rest.is_empty() {
            if self.line.len() + rest.len() > MAX_LINE {
                return Err(too_long());
            }
            self.line.extend_from_slice(rest);
        }
        Ok(out)
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if line.is_empty() {
            if self.has_data || self.event.is_some() {
                out.push(SseEvent {
                    event: self.event.take(),
                    data: std::mem::take(&mut self.data),
                });
                self.has_data = false;
            }
            return Ok(());
        }
        let Some((field, value)) = field_of(line)? else {
            return Ok(());
        };
        match field {
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.event = Some(value.to_string()),
            _ => {}
        }
        Ok(())
    }

    /// Whether a partial event is buffered (bytes after the last blank line).
    pub fn has_partial(&self) -> bool {
        !self.line.is_empty() || self.has_data
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = "data: {\"a\":1}\n\n: keepalive\n\nevent: error\ndata: {\"error\":{}}\n\r\ndata: line1\ndata: line2\r\n\r\ndata:[DONE]\n\n";

    fn all_at_once() -> Vec<SseEvent> {
        SseParser::new().push(STREAM.as_bytes()).unwrap()
    }

    #[test]
    fn parses_events() {
        let ev = all_at_once();
        assert_eq!(ev.len(), 4);
        assert_eq!(ev[0].data, "{\"a\":1}");
        assert_eq!(ev[1].event.as_deref(), Some("error"));
        assert_eq!(ev[2].data, "line1\nline2");
        assert_eq!(ev[3].data, "[DONE]");
    }

    #[test]
    fn any_split_gives_the_same_events() {
        let whole = all_at_once();
        let bytes = STREAM.as_bytes();
        // Every two-way and a sample of three-way splits.
        for i in 0..=bytes.len() {
            for j in (i..=bytes.len()).step_by(7) {
                let mut p = SseParser::new();
                let mut got = p.push(&bytes[..i]).unwrap();
                got.extend(p.push(&bytes[i..j]).unwrap());
                got.extend(p.push(&bytes[j..]).unwrap());
                assert_eq!(got, whole, "split at {i},{j}");
            }
        }
        // Byte by byte.
        let mut p = SseParser::new();
        let mut got = Vec::new();
        for b in bytes {
            got.extend(p.push(std::slice::from_ref(b)).unwrap());
        }
        assert_eq!(got, whole);
    }

    #[test]
    fn an_empty_push_between_a_split_crlf_does_not_end_the_event() {
        // Found by the differential property test: a zero-length push after a `\r` forgot
        // the `\r`, so the `\n` that followed read as a blank line and cut the event in two.
        let mut p = SseParser::new();
        let mut got = p.push(b"data: a\r").unwrap();
        assert!(got.is_empty());
        got.extend(p.push(b"").unwrap());
        assert!(got.is_empty());
        got.extend(p.push(b"\ndata: b\n\n").unwrap());
        assert_eq!(
            got,
            [SseEvent {
                event: None,
                data: "a\nb".into()
            }]
        );
    }

    #[test]
    fn garbage_never_panics() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            let mut p = SseParser::new();
            let mut buf = Vec::new();
            for _ in 0..64 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                buf.push((seed & 0xff) as u8);
            }
            let _ = p.push(&buf);
        }
    }

    /// The parser as it was first written, a byte at a time: the reference the line-at-a-time
    /// parser is held to.
    #[derive(Default)]
    struct Reference {
        line: Vec<u8>,
        event: Option<String>,
        data: Vec<String>,
        has_data: bool,
        last_was_cr: bool,
    }

    impl Reference {
        fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
            let mut out = Vec::new();
            for &b in bytes {
                if self.last_was_cr {
                    self.last_was_cr = false;
                    if b == b'\n' {
                        continue;
                    }
                }
                match b {
                    b'\n' | b'\r' => {
                        self.last_was_cr = b == b'\r';
                        let line = std::mem::take(&mut self.line);
                        self.line_done(&line, &mut out)?;
                    }
                    _ => {
                        if self.line.len() >= MAX_LINE {
                            return Err(SseError("SSE line over 4 MiB".into()));
                        }
                        self.line.push(b);
                    }
                }
            }
            Ok(out)
        }

        fn line_done(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
            if line.is_empty() {
                if self.has_data || self.event.is_some() {
                    out.push(SseEvent {
                        event: self.event.take(),
                        data: std::mem::take(&mut self.data).join("\n"),
                    });
                    self.has_data = false;
                }
                return Ok(());
            }
            let Some((field, value)) = field_of(line)? else {
                return Ok(());
            };
            match field {
                "data" => {
                    self.data.push(value.to_string());
                    self.has_data = true;
                }
                "event" => self.event = Some(value.to_string()),
                _ => {}
            }
            Ok(())
        }
    }

    /// Bytes that look like SSE: field names, colons, spaces, every line ending, `[DONE]`, a
    /// byte that is not UTF-8, and plain letters.
    fn sse_like() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let piece = prop_oneof![
            Just(b"data".to_vec()),
            Just(b"event".to_vec()),
            Just(b"id".to_vec()),
            Just(b":".to_vec()),
            Just(b" ".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"\r".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b"[DONE]".to_vec()),
            Just(vec![0xff]),
            Just("é".as_bytes().to_vec()),
            proptest::collection::vec(b'a'..=b'z', 1..6),
        ];
        proptest::collection::vec(piece, 0..40).prop_map(|v| v.concat())
    }

    proptest::proptest! {
        /// Whatever the bytes and however they are split, both parsers give the same events, or
        /// both fail at the same push.
        #[test]
        fn same_events_as_the_byte_at_a_time_parser(bytes in sse_like(), cuts in proptest::collection::vec(0usize..400, 0..5)) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let (mut new, mut old) = (SseParser::new(), Reference::default());
            let mut at = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                let (a, b) = (new.push(&bytes[at..c]), old.push(&bytes[at..c]));
                proptest::prop_assert_eq!(&a, &b);
                if a.is_err() {
                    break;
                }
                proptest::prop_assert_eq!(new.has_partial(), !old.line.is_empty() || old.has_data);
                at = c;
            }
            // And every split in two (a `\r\n` cut between pushes, say).
            for i in 0..=bytes.len() {
                let (mut new, mut old) = (SseParser::new(), Reference::default());
                let a = new.push(&bytes[..i]).and_then(|mut e| { e.extend(new.push(&bytes[i..])?); Ok(e) });
                let b = old.push(&bytes[..i]).and_then(|mut e| { e.extend(old.push(&bytes[i..])?); Ok(e) });
                proptest::prop_assert_eq!(a, b, "split at {}", i);
            }
        }
    }

    /// The 4 MiB line limit holds for a line given whole and for one given in pieces.
    #[test]
    fn a_line_over_the_limit_is_refused_either_way() {
        let mut line = vec![b'a'; MAX_LINE];
        assert!(SseParser::new().push(&line).is_ok());
        let mut whole = line.clone();
        whole.push(b'\n');
        assert!(SseParser::new().push(&whole).is_ok());
        line.push(b'a');
        assert!(SseParser::new().push(&line).is_err());
        let mut p = SseParser::new();
        assert!(p.push(&line[..MAX_LINE / 2]).is_ok());
        assert!(p.push(&line[MAX_LINE / 2..]).is_err());
        line.push(b'\n');
        assert!(SseParser::new().push(&line).is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(chunks in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..64), 0..8)) {
            let mut p = SseParser::new();
            for c in &chunks {
                let _ = p.push(c);
            }
        }

        #[test]
        fn arbitrary_splits_give_the_same_events(cuts in proptest::collection::vec(0usize..400, 0..6)) {
            let whole = all_at_once();
            let bytes = STREAM.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut p = SseParser::new();
            let mut got = Vec::new();
            let mut at = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                got.extend(p.push(&bytes[at..c]).unwrap());
                at = c;
            }
            proptest::prop_assert_eq!(got, whole);
        }
    }
}
