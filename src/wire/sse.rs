//! An incremental Server-Sent Events parser: bytes in, complete events out, however the bytes
//! were split across reads. Handles `\n`, `\r\n` and `\r` line endings, multi-line `data:`,
//! comments, and a missing space after the colon.

/// One event: its `event:` name (if any) and its `data:` lines joined with `\n`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

/// One event as [`SseParser::push_each`] lends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event<'a> {
    pub event: Option<&'a str>,
    pub data: &'a str,
}

#[derive(Debug)]
pub struct SseParser {
    /// The start of a line the last push did not finish.
    line: Vec<u8>,
    event: Option<String>,
    /// The event's `data:` lines so far, joined with `\n`.
    data: String,
    has_data: bool,
    last_was_cr: bool,
    /// Bytes read since the end of the last blank line: the unfinished event's, which a relay
    /// holds back until the event is whole.
    pending: usize,
    /// The most one event may take, blank line aside (`limits.max_event_bytes`).
    max_event: usize,
    /// Where, in the last push's bytes, each event it returned ended (after its blank line).
    ends: Vec<usize>,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::with_max_event(DEFAULT_MAX_EVENT)
    }
}

/// The most of an event's data buffer kept for the next event.
const KEEP_DATA: usize = 64 * 1024;

/// A line longer than this is not SSE from an LLM server; refusing it bounds memory on garbage.
const MAX_LINE: usize = 4 * 1024 * 1024;

/// `limits.max_event_bytes`' default.
pub const DEFAULT_MAX_EVENT: usize = crate::config::DEFAULT_MAX_EVENT_BYTES;

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

    /// A parser that refuses an event of more than `max_event` bytes.
    pub fn with_max_event(max_event: usize) -> Self {
        SseParser {
            line: Vec::new(),
            event: None,
            data: String::new(),
            has_data: false,
            last_was_cr: false,
            pending: 0,
            max_event: max_event.max(1),
            ends: Vec::new(),
        }
    }

    /// Bytes of the unfinished event (read since the last blank line): a relay that forwards
    /// only whole events holds these back.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Where, in the bytes of the last push, each event it returned ended (its blank line
    /// included), in order.
    pub fn ends(&self) -> &[usize] {
        &self.ends
    }

    /// Feeds bytes; returns the events they completed. See [`SseParser::push_each`], which
    /// lends each event instead.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        let mut out = Vec::new();
        self.push_each(bytes, |e| {
            out.push(SseEvent {
                event: e.event.map(str::to_string),
                data: e.data.to_string(),
            })
        })?;
        Ok(out)
    }

    /// Feeds bytes; hands `each` the events they completed, in order, lent for the call. Lines
    /// are found with `memchr` and read where they lie: an event whose one `data:` line lies in
    /// these bytes is lent from them, not copied; only the unfinished end of a push is copied,
    /// to be completed by the next. On an error, events before it may have been handed over.
    pub fn push_each<'b>(
        &mut self,
        bytes: &'b [u8],
        mut each: impl FnMut(Event<'_>),
    ) -> Result<(), SseError> {
        self.ends.clear();
        let mut rest = bytes;
        // The event's one `data:` line so far, when it lies in `bytes`.
        let mut lent: Option<&'b str> = None;
        // Where in `bytes` the last blank line ended (`None`: not in this push).
        let mut boundary = None;
        // A `\r\n` split between two pushes. An empty push (a zero-length body frame) between
        // them changes nothing: the `\n` that follows still ends the `\r`'s line, not another.
        if self.last_was_cr && !rest.is_empty() {
            self.last_was_cr = false;
            if let Some(tail) = rest.strip_prefix(b"\n") {
                rest = tail;
                if self.pending == 0 {
                    // The `\n` of a blank line's `\r\n`: it belongs to the ended event.
                    boundary = Some(1);
                }
            }
        }
        let lines = loop {
            let Some(i) = memchr::memchr2(b'\n', b'\r', rest) else {
                break Ok(());
            };
            let (head, end) = (&rest[..i], rest[i]);
            let blank = head.is_empty() && self.line.is_empty();
            let sent = if self.line.is_empty() {
                if head.len() > MAX_LINE {
                    break Err(too_long());
                }
                match self.line_done(head, Some(&mut lent), &mut each) {
                    Ok(sent) => sent,
                    Err(e) => break Err(e),
                }
            } else {
                if self.line.len() + head.len() > MAX_LINE {
                    break Err(too_long());
                }
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(head);
                let sent = self.line_done(&line, None, &mut each);
                // The buffer is kept for the next unfinished line.
                line.clear();
                self.line = line;
                match sent {
                    Ok(sent) => sent,
                    Err(e) => break Err(e),
                }
            };
            rest = &rest[i + 1..];
            if end == b'\r' {
                match rest.first() {
                    Some(b'\n') => rest = &rest[1..],
                    None => self.last_was_cr = true,
                    Some(_) => {}
                }
            }
            let at = bytes.len() - rest.len();
            if blank {
                boundary = Some(at);
                if sent {
                    self.ends.push(at);
                }
            } else {
                // An event's size is checked as its lines end; its last, unfinished line is
                // checked by `MAX_LINE` and below.
                let since = boundary.map_or(self.pending + at, |b| at - b);
                if since > self.max_event {
                    break Err(self.too_large());
                }
            }
        };
        // The unfinished event's lent line is the next push's to complete: copied (after an
        // error too, so the parser's state is what the bytes before it made).
        if let Some(d) = lent {
            self.data.push_str(d);
        }
        lines?;
        if !rest.is_empty() {
            if self.line.len() + rest.len() > MAX_LINE {
                return Err(too_long());
            }
            self.line.extend_from_slice(rest);
        }
        self.pending = match boundary {
            Some(b) => bytes.len() - b,
            None => self.pending + bytes.len(),
        };
        if self.pending > self.max_event {
            return Err(self.too_large());
        }
        Ok(())
    }

    fn too_large(&self) -> SseError {
        SseError(format!(
            "SSE event over {} bytes (limits.max_event_bytes)",
            self.max_event
        ))
    }

    /// A whole line. `lent` is where a line of the push's own bytes may leave the event's only
    /// `data:` line (`None` for a line joined across pushes). Whether an event was handed over.
    fn line_done<'b>(
        &mut self,
        line: &'b [u8],
        lent: Option<&mut Option<&'b str>>,
        each: &mut impl FnMut(Event<'_>),
    ) -> Result<bool, SseError> {
        if line.is_empty() {
            let lent = lent.and_then(Option::take);
            if self.has_data || self.event.is_some() {
                each(Event {
                    event: self.event.as_deref(),
                    data: lent.unwrap_or(&self.data),
                });
                self.event = None;
                // Its buffer is kept for the next event that needs one, unless a large event
                // grew it.
                if self.data.capacity() > KEEP_DATA {
                    self.data = String::new();
                } else {
                    self.data.clear();
                }
                self.has_data = false;
                return Ok(true);
            }
            return Ok(false);
        }
        // The common line first: `data:`, read without looking for its colon.
        let (field, value) = match line.strip_prefix(b"data:") {
            Some(v) => {
                let v =
                    std::str::from_utf8(v).map_err(|_| SseError("SSE line is not UTF-8".into()))?;
                ("data", v.strip_prefix(' ').unwrap_or(v))
            }
            None => match field_of(line)? {
                Some(fv) => fv,
                None => return Ok(false),
            },
        };
        match field {
            "data" => match lent {
                Some(slot) if !self.has_data => {
                    *slot = Some(value);
                    self.has_data = true;
                }
                slot => {
                    // A second `data:` line (or a joined one): the event's data is copied.
                    if let Some(first) = slot.and_then(Option::take) {
                        self.data.push_str(first);
                    }
                    if self.has_data {
                        self.data.push('\n');
                    }
                    self.data.push_str(value);
                    self.has_data = true;
                }
            },
            "event" => self.event = Some(value.to_string()),
            _ => {}
        }
        Ok(false)
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

    /// An error in a push leaves the parser as the bytes before it made it: an event whose
    /// `data:` line was lent from the failing push still has that data.
    #[test]
    fn an_error_mid_push_keeps_what_came_before_it() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: abc\n\xff\n").is_err());
        assert!(p.has_partial());
        let ev = p.push(b"\n").unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].data, "abc");
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

    /// What a relay that holds back `pending()` forwards after each push: the bytes up to the
    /// last blank line, however the input was split.
    fn relay(p: &mut SseParser, pushes: &[&[u8]]) -> Result<Vec<u8>, SseError> {
        let mut held: Vec<u8> = Vec::new();
        let mut sent = Vec::new();
        for push in pushes {
            p.push(push)?;
            held.extend_from_slice(push);
            let cut = held.len() - p.pending();
            sent.extend(held.drain(..cut));
        }
        Ok(sent)
    }

    /// Where the last blank line of `bytes` ends (the reference: a line at a time).
    fn last_boundary(bytes: &[u8]) -> usize {
        let mut at = 0;
        let mut line_start = 0;
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'\n' || bytes[i] == b'\r' {
                let blank = i == line_start;
                let mut end = i + 1;
                if bytes[i] == b'\r' && bytes.get(i + 1) == Some(&b'\n') {
                    end += 1;
                }
                if blank {
                    at = end;
                }
                line_start = end;
                i = end;
            } else {
                i += 1;
            }
        }
        at
    }

    #[test]
    fn a_relay_forwards_whole_events_only() {
        let bytes = STREAM.as_bytes();
        for i in 0..=bytes.len() {
            let mut p = SseParser::new();
            let sent = relay(&mut p, &[&bytes[..i]]).unwrap();
            // The `\n` of a blank line's `\r\n` may wait for the next push.
            let want = last_boundary(&bytes[..i]);
            assert_eq!(sent.len(), want, "prefix of {i}");
            let mut p = SseParser::new();
            let sent = relay(&mut p, &[&bytes[..i], &bytes[i..]]).unwrap();
            assert_eq!(sent, bytes, "whole after a split at {i}");
        }
        // Event ends, per push.
        let mut p = SseParser::new();
        let events = p.push(b"data: a\n\n: c\n\ndata: b\r\n\r\ndata: c").unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(p.ends(), [9, 25]);
        assert_eq!(p.pending(), 7);
    }

    #[test]
    fn an_event_over_the_limit_is_refused_however_it_comes() {
        let mut p = SseParser::with_max_event(100);
        // Lines of data without the blank line that ends the event.
        let line = format!("data: {}\n", "x".repeat(20));
        assert!(p.push(line.repeat(3).as_bytes()).is_ok());
        assert!(p.push(line.as_bytes()).is_err());
        // Whole events under the limit, any number of them.
        let mut p = SseParser::with_max_event(100);
        let ev = format!("data: {}\n\n", "x".repeat(80));
        for _ in 0..100 {
            assert_eq!(p.push(ev.as_bytes()).unwrap().len(), 1);
        }
        // One unfinished line, in pieces.
        let mut p = SseParser::with_max_event(100);
        assert!(p.push(b"data: ").is_ok());
        assert!(p.push(&[b'y'; 200]).is_err());
    }

    /// The 4 MiB line limit holds for a line given whole and for one given in pieces.
    #[test]
    fn a_line_over_the_limit_is_refused_either_way() {
        // No event limit here: the line's own limit is under test.
        let parser = || SseParser::with_max_event(usize::MAX);
        let mut line = vec![b'a'; MAX_LINE];
        assert!(parser().push(&line).is_ok());
        let mut whole = line.clone();
        whole.push(b'\n');
        assert!(parser().push(&whole).is_ok());
        line.push(b'a');
        assert!(parser().push(&line).is_err());
        let mut p = parser();
        assert!(p.push(&line[..MAX_LINE / 2]).is_ok());
        assert!(p.push(&line[MAX_LINE / 2..]).is_err());
        line.push(b'\n');
        assert!(parser().push(&line).is_err());
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
        fn a_relay_of_any_bytes_split_anyhow_forwards_up_to_the_last_blank_line(
            bytes in sse_like(),
            cuts in proptest::collection::vec(0usize..400, 0..6),
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut pushes: Vec<&[u8]> = Vec::new();
            let mut at = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                pushes.push(&bytes[at..c]);
                at = c;
            }
            let mut p = SseParser::new();
            if let Ok(sent) = relay(&mut p, &pushes) {
                let want = last_boundary(&bytes);
                // A trailing `\r\n` blank line's `\n` may be forwarded or wait: both whole.
                proptest::prop_assert!(
                    sent.len() == want || (sent.len() + 1 == want && bytes[want - 1] == b'\n'),
                    "sent {} of {}, boundary {}", sent.len(), bytes.len(), want
                );
                proptest::prop_assert_eq!(&sent[..], &bytes[..sent.len()]);
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
