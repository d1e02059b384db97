//! Durations as users write them: integer or fractional seconds (`timeout: 3`, the seed configs'
//! form) or a string with a unit (`250ms`, `2s`, `5m`, `1h`, `1.5s`).

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// A config duration. Serialises back to milliseconds text so `check-config` prints what it read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Dur(pub Duration);

impl Dur {
    pub const fn secs(s: u64) -> Self {
        Dur(Duration::from_secs(s))
    }
    pub const fn millis(ms: u64) -> Self {
        Dur(Duration::from_millis(ms))
    }
}

/// Parses `"250ms"`, `"2s"`, `"5m"`, `"1h"`, `"1.5s"` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("empty duration".into());
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| "invalid duration: expected e.g. 250ms, 2s, 5m, 1h or 3".to_string())?;
    let scale = match unit.trim() {
        "" | "s" | "sec" | "secs" => 1.0,
        "ms" => 0.001,
        "us" => 0.000_001,
        "m" | "min" | "mins" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        _ => {
            return Err("invalid duration unit: use ms, s, m, h or d".to_string());
        }
    };
    secs_to_duration(value * scale).ok_or_else(|| OUT_OF_RANGE.to_string())
}

/// The longest duration any key accepts, in every form (integer, float, string): 365 days. Far
/// beyond any sensible timeout or window, and far enough from `Instant`'s range that a deadline
/// built from a few of them cannot overflow.
pub const MAX_SECS: u64 = 365 * 86_400;

const OUT_OF_RANGE: &str = "duration out of range: at most 365 days";

fn secs_to_duration(secs: f64) -> Option<Duration> {
    // The check keeps `from_secs_f64` away from the values it panics on (NaN, negative, huge).
    if secs.is_finite() && (0.0..=MAX_SECS as f64).contains(&secs) {
        Some(Duration::from_secs_f64(secs))
    } else {
        None
    }
}

fn whole_secs(v: u64) -> Option<Duration> {
    (v <= MAX_SECS).then(|| Duration::from_secs(v))
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Dur;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a duration: seconds as a number, or a string such as 250ms, 2s, 5m")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Dur, E> {
                whole_secs(v)
                    .map(Dur)
                    .ok_or_else(|| E::custom(OUT_OF_RANGE))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Dur, E> {
                let v = u64::try_from(v).map_err(|_| E::custom("a duration cannot be negative"))?;
                self.visit_u64(v)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Dur, E> {
                secs_to_duration(v)
                    .map(Dur)
                    .ok_or_else(|| E::custom(OUT_OF_RANGE))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Dur, E> {
                parse_duration(v).map(Dur).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for Dur {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{}ms", self.0.as_millis()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_all_forms() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert!(parse_duration("3 fortnights").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn deserialises_numbers_and_strings() {
        let d: Dur = serde_yaml_ng::from_str("3").unwrap();
        assert_eq!(d.0, Duration::from_secs(3));
        let d: Dur = serde_yaml_ng::from_str("0.25").unwrap();
        assert_eq!(d.0, Duration::from_millis(250));
        let d: Dur = serde_yaml_ng::from_str("\"5m\"").unwrap();
        assert_eq!(d.0, Duration::from_secs(300));
        assert!(serde_yaml_ng::from_str::<Dur>("-3").is_err());
    }

    #[test]
    fn every_form_has_the_same_365_day_cap() {
        let year = Duration::from_secs(MAX_SECS);
        for ok in ["31536000", "31536000.0", "\"365d\"", "\"8760h\""] {
            assert_eq!(serde_yaml_ng::from_str::<Dur>(ok).unwrap().0, year, "{ok}");
        }
        for over in [
            "31536001",
            "18446744073709551615",
            "31536000.5",
            "1e300",
            "\"366d\"",
            "\"31536001s\"",
            "\"99999999999999999999999h\"",
        ] {
            let err = serde_yaml_ng::from_str::<Dur>(over)
                .unwrap_err()
                .to_string();
            assert!(err.contains("at most 365 days"), "{over}: {err}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_text_gives_a_bounded_duration_or_an_error(text in ".{0,40}") {
            if let Ok(d) = parse_duration(&text) {
                proptest::prop_assert!(d.as_secs() <= MAX_SECS);
            }
        }
    }
}
