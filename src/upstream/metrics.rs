//! Reading vLLM's Prometheus `/metrics` text for the load figures the health logic uses.

use serde::Serialize;

/// vLLM's load, summed over label sets (one per served model).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VllmLoad {
    pub num_requests_running: Option<f64>,
    pub num_requests_waiting: Option<f64>,
    /// KV-cache usage, 0..1 (`vllm:gpu_cache_usage_perc`, renamed `vllm:kv_cache_usage_perc` in
    /// newer releases).
    pub kv_cache_usage: Option<f64>,
}

pub fn parse_vllm(text: &str) -> VllmLoad {
    let mut load = VllmLoad::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let Some(value) = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        else {
            continue;
        };
        let slot = match name {
            "vllm:num_requests_running" => &mut load.num_requests_running,
            "vllm:num_requests_waiting" => &mut load.num_requests_waiting,
            "vllm:gpu_cache_usage_perc" | "vllm:kv_cache_usage_perc" => &mut load.kv_cache_usage,
            _ => continue,
        };
        *slot = Some(slot.unwrap_or(0.0) + value);
    }
    load
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_metrics() {
        let text = "# HELP vllm:num_requests_running Number of requests running.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"a\"} 3.0\nvllm:num_requests_running{model_name=\"b\"} 1.0\nvllm:num_requests_waiting{model_name=\"a\"} 7.0\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.42\nvllm:other 1\ngarbage line\n";
        let l = parse_vllm(text);
        assert_eq!(l.num_requests_running, Some(4.0));
        assert_eq!(l.num_requests_waiting, Some(7.0));
        assert_eq!(l.kv_cache_usage, Some(0.42));
        assert_eq!(parse_vllm(""), VllmLoad::default());
    }
}
