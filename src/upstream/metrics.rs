//! Reading vLLM's Prometheus `/metrics` text for the load figures the health logic uses.

use serde::Serialize;

/// vLLM's load: the largest figure over label sets (one per engine or served model).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VllmLoad {
    pub num_requests_running: Option<f64>,
    pub num_requests_waiting: Option<f64>,
    /// KV-cache usage, 0..1 (`vllm:gpu_cache_usage_perc`, renamed `vllm:kv_cache_usage_perc` in
    /// newer releases).
    pub kv_cache_usage: Option<f64>,
}

/// Reads the load figures from Prometheus text. Each sample is `name{labels} value [timestamp]`:
/// the value is the field after the labels (never the timestamp), label values may hold spaces
/// and braces inside quotes. Several label sets (one per engine or model) give the maximum, not
/// the sum: two engines at 60% KV-cache use are not at 120%.
pub fn parse_vllm(text: &str) -> VllmLoad {
    let mut load = VllmLoad::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = sample(line) else {
            continue;
        };
        let slot = match name {
            "vllm:num_requests_running" => &mut load.num_requests_running,
            "vllm:num_requests_waiting" => &mut load.num_requests_waiting,
            "vllm:gpu_cache_usage_perc" | "vllm:kv_cache_usage_perc" => &mut load.kv_cache_usage,
            _ => continue,
        };
        *slot = Some(slot.map_or(value, |v: f64| v.max(value)));
    }
    load
}

/// One sample line's metric name and value.
fn sample(line: &str) -> Option<(&str, f64)> {
    let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    if rest.starts_with('{') {
        // Skip the label set, honouring quotes and escapes inside label values.
        let mut in_quotes = false;
        let mut escaped = false;
        let mut end = None;
        for (i, c) in rest.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if in_quotes => escaped = true,
                '"' => in_quotes = !in_quotes,
                '}' if !in_quotes => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        rest = &rest[end? + 1..];
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    value.is_finite().then_some((name, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_metrics() {
        let text = "# HELP vllm:num_requests_running Number of requests running.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"a\"} 3.0\nvllm:num_requests_running{model_name=\"b\"} 1.0\nvllm:num_requests_waiting{model_name=\"a\"} 7.0\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.42\nvllm:other 1\ngarbage line\n";
        let l = parse_vllm(text);
        assert_eq!(
            l.num_requests_running,
            Some(3.0),
            "the maximum, not the sum"
        );
        assert_eq!(l.num_requests_waiting, Some(7.0));
        assert_eq!(l.kv_cache_usage, Some(0.42));
        assert_eq!(parse_vllm(""), VllmLoad::default());
    }

    #[test]
    fn reads_the_value_not_the_timestamp_and_takes_the_maximum() {
        let text = "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a b}\"} 0.61 1712345678901\nvllm:kv_cache_usage_perc{engine=\"1\",model_name=\"a\"} 0.7\nvllm:num_requests_waiting 2 1712345678901\nvllm:num_requests_waiting{x=\"\\\"}\"} 5\n";
        let l = parse_vllm(text);
        assert_eq!(l.kv_cache_usage, Some(0.7));
        assert_eq!(l.num_requests_waiting, Some(5.0));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,400}", line in "vllm:[a-z_]{0,30}(\\{[a-z]{0,5}=\"[^\"]{0,10}\"\\})? ?[0-9e.+-]{0,12} ?[0-9]{0,14}") {
            let _ = parse_vllm(&text);
            let l = parse_vllm(&line);
            for v in [l.kv_cache_usage, l.num_requests_running, l.num_requests_waiting].into_iter().flatten() {
                proptest::prop_assert!(v.is_finite());
            }
        }
    }
}
