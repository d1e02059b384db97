//! Counting through a Hugging Face `tokenizer.json` (vLLM's and Ollama's models): the count
//! `encode_fast(text, false)` would hold before any `truncation` or `padding` the file sets (a
//! count is of the whole text), without building that encoding.
//!
//! The tokenizer's own steps run as `encode_fast` runs them — added tokens split out, the rest
//! normalized — then each piece's tokens come from the model, once for each distinct piece
//! (prose repeats its words), with no token strings, offsets or masks built (most of
//! `encode_fast`'s time). The pre-tokenizer is the tokenizers crate's own, except for the one
//! byte-level BPEs use (GPT-2's `ByteLevel` regex, or a `Split` regex then `ByteLevel` without
//! one, as Llama 3, Qwen and DeepSeek ship): there [`FastSplit`] splits with the `regex` crate
//! instead of fancy-regex (225 KB of prose: 48 ms → a few), by the same rules. Their patterns
//! end in `\s+(?!\S)|\s+` (a run of spaces leaves its last one to the word after it), a lookahead
//! the `regex` crate does not have: the run is matched whole by `\s+` and given back its last
//! character where the lookahead would have. A pattern that the `regex` crate cannot compile
//! otherwise, or that could match nothing, keeps the tokenizers crate's pre-tokenizer.
//! Differential tests below hold both paths to `encode_fast`.

use std::borrow::Cow;
use std::collections::HashMap;

use serde_json::Value;
use tokenizers::{Model, OffsetReferential, OffsetType, PreTokenizer, Tokenizer};

/// GPT-2's pre-tokenizer pattern, as `ByteLevel { use_regex: true }` applies it.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The lookahead tail of the byte-level patterns.
const TAIL: &str = r"|\s+(?!\S)|\s+";

/// A loaded `tokenizer.json`, with the fast splitter its pre-tokenizer allows.
pub struct HfTokenizer {
    tok: Tokenizer,
    split: Option<FastSplit>,
}

impl HfTokenizer {
    pub fn new(tok: Tokenizer) -> HfTokenizer {
        let split = FastSplit::of(&tok);
        HfTokenizer { tok, split }
    }

    /// The tokenizer itself.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// Whether counting splits with the `regex` crate rather than the tokenizer's own
    /// pre-tokenizer.
    pub fn splits_fast(&self) -> bool {
        self.split.is_some()
    }

    /// Tokens of `text` (no special tokens added, no truncation: the whole text's count).
    pub fn count(&self, text: &str) -> tokenizers::Result<u64> {
        match &self.split {
            Some(f) => self.count_fast(f, text),
            None => self.count_general(text),
        }
    }

    /// The tokenizers crate's own pre-tokenizer, then the model once a distinct piece.
    fn count_general(&self, text: &str) -> tokenizers::Result<u64> {
        let tok = &self.tok;
        let mut pieces = tok
            .get_added_vocabulary()
            .extract_and_normalize(tok.get_normalizer(), text);
        if let Some(p) = tok.get_pre_tokenizer() {
            p.pre_tokenize(&mut pieces)?;
        }
        let model = tok.get_model();
        let mut known: HashMap<&str, u64> = HashMap::new();
        let mut n = 0u64;
        for (piece, _, tokens) in pieces.get_splits(OffsetReferential::Normalized, OffsetType::None)
        {
            n += match tokens {
                Some(t) => t.len() as u64,
                None => match known.get(piece) {
                    Some(k) => *k,
                    None => {
                        let k = model.tokenize(piece)?.len() as u64;
                        known.insert(piece, k);
                        k
                    }
                },
            };
        }
        Ok(n)
    }

    /// Added tokens and the normalizer as the tokenizer has them, then [`FastSplit`], then the
    /// model once a distinct piece, on its bytes mapped to GPT-2's characters.
    fn count_fast(&self, f: &FastSplit, text: &str) -> tokenizers::Result<u64> {
        let tok = &self.tok;
        let segments = tok
            .get_added_vocabulary()
            .extract_and_normalize(tok.get_normalizer(), text);
        let model = tok.get_model();
        let mut known: HashMap<String, u64> = HashMap::new();
        let mut mapped = String::new();
        let mut n = 0u64;
        let mut failed = None;
        for (segment, _, tokens) in
            segments.get_splits(OffsetReferential::Normalized, OffsetType::None)
        {
            if let Some(t) = tokens {
                n += t.len() as u64;
                continue;
            }
            // `ByteLevel`'s `add_prefix_space`: a segment not starting with a space gets one.
            let segment: Cow<str> =
                if f.add_prefix_space && !segment.is_empty() && !segment.starts_with(' ') {
                    Cow::Owned(format!(" {segment}"))
                } else {
                    Cow::Borrowed(segment)
                };
            let whole = f.pieces(&segment, |piece| {
                if failed.is_some() {
                    return;
                }
                if let Some(k) = known.get(piece) {
                    n += *k;
                    return;
                }
                mapped.clear();
                mapped.extend(piece.bytes().map(|b| BYTE_CHARS[b as usize]));
                match model.tokenize(&mapped) {
                    Ok(t) => {
                        n += t.len() as u64;
                        known.insert(piece.to_string(), t.len() as u64);
                    }
                    Err(e) => failed = Some(e),
                }
            });
            if !whole {
                // A match of nothing (a pattern whose matches can be empty where they sit):
                // the rules of each engine differ there, so the tokenizer's own counts.
                return self.count_general(text);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }
}

/// A byte-level pre-tokenizer's split, by the `regex` crate.
struct FastSplit {
    /// The pattern, its lookahead tail replaced by `\s+` in a group of its own ([`TAIL_GROUP`]).
    re: regex::Regex,
    /// Whether the pattern had that tail.
    tail: bool,
    add_prefix_space: bool,
}

/// The name of the group the tail's `\s+` is matched in.
const TAIL_GROUP: &str = "autohedge_tail";

impl FastSplit {
    /// The fast split for `tok`'s pre-tokenizer, if it is one of the byte-level shapes and its
    /// pattern compiles here. Read from the pre-tokenizer's own serialization (what a
    /// `tokenizer.json` says), so every field is seen.
    fn of(tok: &Tokenizer) -> Option<FastSplit> {
        let pre = serde_json::to_value(tok.get_pre_tokenizer()?).ok()?;
        let flag = |v: &Value, k: &str| v.get(k).and_then(Value::as_bool);
        match pre.get("type")?.as_str()? {
            "ByteLevel" if flag(&pre, "use_regex")? => {
                FastSplit::new(GPT2, flag(&pre, "add_prefix_space")?)
            }
            "Sequence" => {
                let [split, byte_level] = pre.get("pretokenizers")?.as_array()?.as_slice() else {
                    return None;
                };
                let plain_byte_level = byte_level.get("type")?.as_str()? == "ByteLevel"
                    && !flag(byte_level, "use_regex")?
                    && !flag(byte_level, "add_prefix_space")?;
                let isolating_split = split.get("type")?.as_str()? == "Split"
                    && split.get("behavior")?.as_str()? == "Isolated"
                    && !flag(split, "invert")?;
                if !(plain_byte_level && isolating_split) {
                    return None;
                }
                FastSplit::new(split.get("pattern")?.get("Regex")?.as_str()?, false)
            }
            _ => None,
        }
    }

    fn new(pattern: &str, add_prefix_space: bool) -> Option<FastSplit> {
        let (full, tail) = match pattern.strip_suffix(TAIL) {
            Some(h) => (format!("(?:{h})|(?P<{TAIL_GROUP}>\\s+)"), true),
            None => (pattern.to_string(), false),
        };
        // Lookarounds and backreferences do not compile here: the tokenizer's own then.
        let re = regex::Regex::new(&full).ok()?;
        // A pattern that matches nothing at all splits by rules of each engine's own (one that
        // matches nothing only where it sits is caught as it splits: `pieces`).
        if re.is_match("") {
            return None;
        }
        Some(FastSplit {
            re,
            tail,
            add_prefix_space,
        })
    }

    /// Calls `f` with each piece of `text` in order: the pattern's matches and what lies
    /// between them, as `Split` with `Isolated` makes them. `false` (and not every piece
    /// given) if a match was empty.
    fn pieces<'t>(&self, text: &'t str, mut f: impl FnMut(&'t str)) -> bool {
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.re.find_at(text, pos) else {
                f(&text[pos..]);
                return true;
            };
            if m.start() == m.end() {
                return false;
            }
            if m.start() > pos {
                f(&text[pos..m.start()]);
            }
            let mut end = m.end();
            // Only a match that begins with a space can be the tail's; the groups (a slower
            // search, over this match alone) say whether it is.
            if self.tail
                && m.as_str().starts_with(char::is_whitespace)
                && self
                    .re
                    .captures_at(text, m.start())
                    .is_some_and(|c| c.name(TAIL_GROUP).is_some())
            {
                // The tail's run of whitespace: `\s+(?!\S)` gives back its last character
                // when a non-space follows (a run of one is `\s+`'s, kept whole).
                let run = m.as_str();
                let followed = text[end..].starts_with(|c: char| !c.is_whitespace());
                if followed
                    && let Some((last, _)) = run.char_indices().next_back()
                    && last > 0
                {
                    end = m.start() + last;
                }
            }
            f(&text[m.start()..end]);
            pos = end;
        }
        true
    }
}

/// GPT-2's bytes-to-characters map (its `bytes_to_unicode`): printable bytes stand for
/// themselves, the rest for characters from U+0100 on, in order.
static BYTE_CHARS: std::sync::LazyLock<[char; 256]> = std::sync::LazyLock::new(|| {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            u32::from(b)
        } else {
            let c = next;
            next += 1;
            c
        };
        map[b as usize] = char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER);
    }
    map
});

/// Both counting paths against the `tokenizers` crate's own `encode_fast`, on tokenizers of the
/// kinds local models ship (GPT-2's byte-level BPE, a Llama-3-style `Split` + `ByteLevel`,
/// SentencePiece-style BPE, WordPiece with a lower-casing normalizer), each with added tokens,
/// special and not, normalized and not.
#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::LazyLock;
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::models::wordpiece::{WordPiece, WordPieceTrainerBuilder};
    use tokenizers::normalizers::bert::BertNormalizer;
    use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::{AddedToken, SplitDelimiterBehavior};

    /// Llama 3's pattern (its `tokenizer.json`).
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    const CORPUS: &str = "The gateway routes every request to the endpoint that can answer it.\n\
        When an upstream fails, the request fails over to the next one in the chain.\n\
        Streams are forwarded chunk by chunk; a broken stream may be continued elsewhere.\n\
        Les passerelles répondent même quand un serveur tombe. 网关在上游故障时切换。\n\
        fn main() { println!(\"hello, world\"); } // code, too: x += 1;\n\
        It's what they'll say: we've 1234567 tokens   and\ttabs\r\n\n  indented.\n";

    fn added(tok: &mut Tokenizer) {
        tok.add_special_tokens(&[
            AddedToken::from("<|im_start|>", true),
            AddedToken::from("<|im_end|>", true),
        ]);
        tok.add_tokens(&[
            AddedToken::from("Hedge", false).normalized(true),
            AddedToken::from("[TOOL]", false).normalized(false),
        ]);
    }

    fn bpe(pre: impl Into<tokenizers::PreTokenizerWrapper>, alphabet: Vec<char>) -> HfTokenizer {
        let mut tok = Tokenizer::new(BPE::default());
        tok.with_pre_tokenizer(Some(pre));
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(600)
            .show_progress(false)
            .initial_alphabet(alphabet.into_iter().collect())
            .build()
            .into();
        tok.train(&mut trainer, CORPUS.lines()).unwrap();
        added(&mut tok);
        HfTokenizer::new(tok)
    }

    /// A BPE behind a `Split` on `pattern` then a regex-less `ByteLevel` (Llama 3's shape).
    fn split_then_byte_level(pattern: &str) -> HfTokenizer {
        bpe(
            Sequence::new(vec![
                Split::new(
                    SplitPattern::Regex(pattern.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap()
                .into(),
                ByteLevel::new(false, true, false).into(),
            ]),
            ByteLevel::alphabet().into_iter().collect(),
        )
    }

    static KINDS: LazyLock<Vec<(&str, HfTokenizer)>> = LazyLock::new(|| {
        let alphabet = || ByteLevel::alphabet().into_iter().collect::<Vec<_>>();
        let gpt2 = bpe(ByteLevel::default(), alphabet());
        let gpt2_no_prefix = bpe(ByteLevel::new(false, true, true), alphabet());
        let llama3 = split_then_byte_level(LLAMA3);
        let metaspace = bpe(Metaspace::new('▁', PrependScheme::First, true), Vec::new());
        let mut word_piece = Tokenizer::new(WordPiece::default());
        word_piece.with_normalizer(Some(BertNormalizer::default()));
        word_piece.with_pre_tokenizer(Some(BertPreTokenizer));
        let mut trainer: TrainerWrapper = WordPieceTrainerBuilder::new()
            .vocab_size(400)
            .show_progress(false)
            .special_tokens(vec![AddedToken::from("[UNK]", true)])
            .build()
            .into();
        word_piece.train(&mut trainer, CORPUS.lines()).unwrap();
        added(&mut word_piece);
        vec![
            ("GPT-2 byte-level BPE", gpt2),
            ("GPT-2 byte-level BPE, no prefix space", gpt2_no_prefix),
            ("Llama-3-style Split + ByteLevel", llama3),
            ("SentencePiece-style BPE", metaspace),
            ("WordPiece", HfTokenizer::new(word_piece)),
        ]
    });

    fn reference(tok: &HfTokenizer, text: &str) -> u64 {
        tok.tokenizer().encode_fast(text, false).unwrap().len() as u64
    }

    #[test]
    fn the_byte_level_shapes_split_fast_and_the_others_do_not() {
        let fast: Vec<bool> = KINDS.iter().map(|(_, t)| t.splits_fast()).collect();
        assert_eq!(fast, [true, true, true, false, false]);
    }

    #[test]
    fn counts_what_encode_fast_holds() {
        let texts = [
            "",
            " ",
            "  ",
            "The gateway routes every request.",
            "<|im_start|>user\nHedge the gateway<|im_end|>\n<|im_start|>assistant\n",
            "HEDGE hedge Hedge [TOOL] [tool]",
            "   leading and trailing   \n\n\t",
            "a  b   c\t\td \n e\r\n\r\nf  ",
            "IT'S THEY'LL it's they'll 'S",
            "12345678901 1.5e10 $100",
            "网关在上游故障时切换。 emoji 🦀🦀 and é",
            "unseen words: zyxwvut qqqq\u{00A0}\u{2003}nbsp",
            &CORPUS.repeat(3),
        ];
        for (kind, tok) in KINDS.iter() {
            for t in texts {
                assert_eq!(tok.count(t).unwrap(), reference(tok, t), "{kind}: {t:?}");
                assert_eq!(
                    tok.count_general(t).unwrap(),
                    reference(tok, t),
                    "{kind} (general path): {t:?}"
                );
            }
        }
        // The added tokens are what the texts say they are: one token each.
        assert_eq!(KINDS[0].1.count("<|im_start|>").unwrap(), 1);
    }

    /// A pattern whose matches can be empty where they sit (`\b` alone): counting neither
    /// loops nor differs, the tokenizer's own pre-tokenizer takes over.
    #[test]
    fn a_pattern_that_matches_nothing_somewhere_counts_by_the_tokenizers_own_rules() {
        let pattern = r"\p{L}*\b|\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
        let tok = split_then_byte_level(pattern);
        assert!(tok.splits_fast(), "the pattern compiles here");
        for t in [
            "a b",
            "The gateway routes.",
            "  x  ",
            "12 ab!!",
            &CORPUS.repeat(2),
        ] {
            assert_eq!(tok.count(t).unwrap(), reference(&tok, t), "{t:?}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn any_text_counts_as_encode_fast(text in "(gateway|request|Hedge|HEDGE|'s|'LL|<\\|im_start\\|>|<\\|im_end\\|>|\\[TOOL\\]|[a-zA-Z]{1,6}|[0-9]{1,5}| {1,3}|[\t\r\n]{1,2}|\u{00A0}|\\PC{1,3}){0,24}") {
            for (kind, tok) in KINDS.iter() {
                prop_assert_eq!(tok.count(&text).unwrap(), reference(tok, &text), "{}", kind);
            }
        }
    }
}
