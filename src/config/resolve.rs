//! Validation and resolution: `Raw*` → runtime types. Keys from `env:`/`file:` become `Secret`s
//! with a hash of their value; each endpoint gets its HTTP client (one shared rustls config, or
//! its own with a `ca_file`), its token counter (built here, so no request waits for an
//! encoder), its upstream URL per operation, and the fingerprint its retirements are stored under.

use super::*;
use crate::op::Op;

/// The URL of `op` on an endpoint of `kind` rooted at `base_url` (built once per config load;
/// per request only for a discovered task's address).
pub fn url_for(kind: EndpointKind, base_url: &str, op: Op) -> String {
    match kind {
        EndpointKind::Openai | EndpointKind::Vllm => format!("{base_url}{}", op.openai_path()),
        EndpointKind::Ollama => {
            // `host` is the bare server (http://127.0.0.1:11434); tolerate a configured `/v1`.
            let base = base_url.trim_end_matches("/v1");
            format!("{base}{}", op.ollama_path())
        }
    }
}

/// The TLS settings upstream clients share: the bundled web roots plus the system's CA store,
/// built once per process (loading the system store per client would cost every reload tens of
/// milliseconds per endpoint). `extra_pem` (an endpoint's `ca_file`) gets its own config.
/// The endpoint's direct HTTP client for requests: hyper-util's pooled client over the same TLS
/// config (HTTP/1.1 and HTTP/2 by ALPN), with the endpoint's connect timeout. reqwest's layers
/// cost a quarter of the gateway's instructions a request (its redirect policy parses the URL
/// twice a request even when redirects are off). `None` when a proxy is configured in the
/// environment: reqwest honours `HTTP(S)_PROXY`/`ALL_PROXY`/`NO_PROXY`, so those requests go
/// through it as before.
fn direct_client(tls: &rustls::ClientConfig, connect: Duration) -> Option<DirectClient> {
    let proxied = [
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()));
    if proxied {
        return None;
    }
    Some(
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(timed_connector(tls, connect)),
    )
}

/// How long a connection to an upstream may sit idle before it is closed.
const POOL_IDLE: Duration = Duration::from_secs(60);

/// Idle connections kept per plain-`http` endpoint, at most.
const POOL_MAX_IDLE: usize = 256;

/// TCP (and TLS for `https`) under the endpoint's connect timeout.
fn timed_connector(tls: &rustls::ClientConfig, connect: Duration) -> TimedConnector {
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    // The connector sets ALPN itself (h2, http/1.1) and refuses a config that already has it.
    let mut tls = tls.clone();
    tls.alpn_protocols.clear();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    TimedConnector {
        inner: https,
        timeout: connect,
    }
}

/// The plain-`http` endpoint's own connections, when its requests can use them: an `http` URL
/// without credentials in it, and the direct client in use (no proxy configured).
fn plain(
    connector: TimedConnector,
    direct: bool,
    uris: &[http::Uri; Op::ALL.len()],
) -> Option<Plain> {
    let first = &uris[0];
    let authority = first.authority()?;
    if !direct || first.scheme_str() != Some("http") || authority.as_str().contains('@') {
        return None;
    }
    let path = |u: &http::Uri| {
        u.path_and_query()
            .map_or("/", |p| p.as_str())
            .parse::<http::Uri>()
            .ok()
    };
    let target = http::Uri::builder()
        .scheme("http")
        .authority(authority.clone())
        .path_and_query("/")
        .build()
        .ok()?;
    Some(Plain {
        pool: crate::upstream::h1pool::H1Pool::new(connector, target, POOL_IDLE, POOL_MAX_IDLE),
        paths: [
            path(&uris[0])?,
            path(&uris[1])?,
            path(&uris[2])?,
            path(&uris[3])?,
        ],
        // Without credentials (refused above), the authority is `host[:port]`.
        host: http::HeaderValue::from_str(authority.as_str()).ok()?,
    })
}

fn tls_config(extra_pem: Option<&[u8]>) -> Result<rustls::ClientConfig, String> {
    use std::sync::LazyLock;
    static ROOTS: LazyLock<Arc<rustls::RootCertStore>> = LazyLock::new(|| {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let native = rustls_native_certs::load_native_certs();
        for e in &native.errors {
            tracing::debug!(error = %e, "system CA store: entry skipped");
        }
        let (added, _) = roots.add_parsable_certificates(native.certs);
        tracing::debug!(added, "system CA certificates trusted");
        Arc::new(roots)
    });
    let roots = match extra_pem {
        None => ROOTS.clone(),
        Some(pem) => {
            use rustls::pki_types::pem::PemObject;
            let mut roots = (**ROOTS).clone();
            let mut n = 0;
            for cert in rustls::pki_types::CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|_| "not a PEM certificate bundle".to_string())?;
                roots
                    .add(cert)
                    .map_err(|e| format!("certificate rejected: {e}"))?;
                n += 1;
            }
            if n == 0 {
                return Err("holds no PEM certificate".into());
            }
            Arc::new(roots)
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(cfg)
}

/// A configured duration, or its default.
fn or_default(v: Option<Dur>, default: Duration) -> Duration {
    v.map_or(default, |d| d.0)
}

/// A short, stable hash of a secret's value: enough to tell values apart, useless to recover one.
fn value_hash(v: &str) -> String {
    key_digest(v)
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn default_timeouts(kind: EndpointKind) -> Timeouts {
    // Local servers load models lazily: their first token can take far longer than a cloud's.
    match kind {
        EndpointKind::Openai => Timeouts {
            connect: Duration::from_secs(2),
            first_token: Duration::from_secs(10),
            total: Duration::from_secs(120),
        },
        EndpointKind::Vllm | EndpointKind::Ollama => Timeouts {
            connect: Duration::from_secs(2),
            first_token: Duration::from_secs(30),
            total: Duration::from_secs(300),
        },
    }
}

fn default_capabilities(kind: EndpointKind) -> BTreeSet<Capability> {
    use Capability::*;
    match kind {
        EndpointKind::Openai => [Chat, Completions, Embeddings, Tools, Vision, Responses].into(),
        // Vision depends on the model a local server runs: opt in with `capabilities:`.
        EndpointKind::Vllm => [Chat, Completions, Embeddings, Tools, Continue, Responses].into(),
        EndpointKind::Ollama => [Chat, Completions, Embeddings, Tools].into(),
    }
}

pub(super) fn build(raw: RawConfig, fetched: &Fetched) -> Result<Config, ConfigError> {
    let mut warnings = Vec::new();
    let vault = raw.vault.as_ref().map(vault_settings).transpose()?;
    let vault_digest = vault
        .as_ref()
        .map(|_| crate::config::vault::digest(fetched));
    let auth = auth(&raw.auth, &raw.models, &raw.routes, fetched, &mut warnings)?;
    let alerts = alerts(raw.alerts.as_ref(), fetched, &mut warnings)?;
    let cluster = cluster(raw.cluster.as_ref(), fetched)?;
    let otlp = otlp(raw.telemetry.otlp.as_ref(), fetched)?;
    let audit_pg = audit_pg(raw.audit.as_ref(), fetched)?;
    if raw.models.is_empty() {
        return Err(ConfigError(
            "at `models`: at least one endpoint is required".into(),
        ));
    }
    let mut endpoints = BTreeMap::new();
    let mut last_resort = BTreeMap::new();
    for (name, ep) in raw.models {
        if let Some(l) = &ep.last_resort {
            last_resort.insert(
                name.clone(),
                last_resort_spec(&format!("models.{name}.last_resort"), l)?,
            );
        }
        let at = format!("models.{name}");
        // `base_urls`: each an address of the endpoint, checked as `base_url` is (credentials
        // go in `api_key` or `headers`: a URL of several is shown per address in `/status`).
        let mut addresses = Vec::new();
        if let Some(urls) = &ep.base_urls {
            if ep.base_url.is_some() || ep.host.is_some() || ep.discover.is_some() {
                return Err(ConfigError(format!(
                    "at `{at}`: give `base_urls` or `base_url` (or `host`, or `discover`), not both"
                )));
            }
            if urls.is_empty() || urls.len() > MAX_ADDRESSES {
                return Err(ConfigError(format!(
                    "at `{at}.base_urls`: give 1 to {MAX_ADDRESSES} URLs"
                )));
            }
            for (i, u) in urls.iter().enumerate() {
                let parsed = reqwest::Url::parse(u.trim_end_matches('/')).map_err(|e| {
                    ConfigError(format!("at `{at}.base_urls[{i}]`: invalid URL: {e}"))
                })?;
                if !matches!(parsed.scheme(), "http" | "https") {
                    return Err(ConfigError(format!(
                        "at `{at}.base_urls[{i}]`: scheme must be http or https"
                    )));
                }
                if !parsed.username().is_empty() || parsed.password().is_some() {
                    return Err(ConfigError(format!(
                        "at `{at}.base_urls[{i}]`: no user or password in the URL (give the key in `api_key`)"
                    )));
                }
                let u = parsed.as_str().trim_end_matches('/').to_string();
                if addresses.contains(&u) {
                    return Err(ConfigError(format!(
                        "at `{at}.base_urls[{i}]`: the same address twice"
                    )));
                }
                addresses.push(u);
            }
        }
        let base = match (ep.base_url, ep.host) {
            (Some(_), Some(_)) => {
                return Err(ConfigError(format!(
                    "at `{at}`: give either `base_url` or `host` (its alias), not both"
                )));
            }
            (None, None) if !addresses.is_empty() => addresses[0].clone(),
            (Some(u), None) | (None, Some(u)) => u,
            (None, None) if ep.discover.is_some() => "http://discovered.invalid".to_string(),
            (None, None) => match ep.kind {
                EndpointKind::Ollama => "http://127.0.0.1:11434".to_string(),
                EndpointKind::Vllm => "http://127.0.0.1:8000/v1".to_string(),
                EndpointKind::Openai => "https://api.openai.com/v1".to_string(),
            },
        };
        let mut base_url = base.trim_end_matches('/').to_string();
        // The URL is not echoed: it may carry credentials (`https://user:pass@host`).
        let mut parsed = reqwest::Url::parse(&base_url)
            .map_err(|e| ConfigError(format!("at `{at}.base_url`: invalid URL: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(ConfigError(format!(
                "at `{at}.base_url`: scheme must be http or https"
            )));
        }
        // Credentials in the URL are sent as HTTP Basic auth (as curl and reqwest do) and taken
        // out of it: the URL is shown by `check-config`, in logs, error details and the
        // endpoint's fingerprint, none of which may hold a password.
        let basic = if !parsed.username().is_empty() || parsed.password().is_some() {
            let user = percent_decoded(parsed.username());
            let pass = parsed.password().map(percent_decoded).unwrap_or_default();
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            base_url = parsed.as_str().trim_end_matches('/').to_string();
            Some((user, pass))
        } else {
            None
        };
        let specs: Vec<String> = match (ep.api_key, ep.api_keys) {
            (Some(_), Some(_)) => {
                return Err(ConfigError(format!(
                    "at `{at}`: give either `api_key` or `api_keys`, not both"
                )));
            }
            (Some(k), None) => vec![k],
            (None, Some(ks)) => ks,
            (None, None) => vec![],
        };
        let mut keys = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let source = KeySource::parse(spec);
            match source.resolve(spec, fetched) {
                Ok(v) => keys.push(ApiKey {
                    source,
                    hash: value_hash(v.expose()),
                    value: Some(v),
                    problem: None,
                }),
                Err(problem) => {
                    warnings.push(format!("{at}: api key #{} ({source}): {problem}", i + 1));
                    keys.push(ApiKey {
                        source,
                        hash: String::new(),
                        value: None,
                        problem: Some(problem),
                    });
                }
            }
        }
        let mut timeouts = default_timeouts(ep.kind);
        if let Some(t) = ep.timeout {
            timeouts.total = t.0;
        }
        if let Some(t) = ep.timeouts {
            if let Some(v) = t.connect {
                timeouts.connect = v.0;
            }
            if let Some(v) = t.first_token {
                timeouts.first_token = v.0;
            }
            if let Some(v) = t.total {
                timeouts.total = v.0;
            }
        }
        for (what, d) in [
            ("connect", timeouts.connect),
            ("first_token", timeouts.first_token),
            ("total", timeouts.total),
        ] {
            if d.is_zero() {
                return Err(ConfigError(format!(
                    "at `{at}.timeouts.{what}`: must be greater than zero"
                )));
            }
        }
        if let Some(0) = ep.context_window {
            return Err(ConfigError(format!(
                "at `{at}.context_window`: must be greater than zero"
            )));
        }
        let mut headers = Vec::new();
        let mut header_secrets = Vec::new();
        for (k, v) in ep.headers.unwrap_or_default() {
            if reqwest::header::HeaderName::from_bytes(k.as_bytes()).is_err() {
                return Err(ConfigError(format!(
                    "at `{at}.headers`: invalid header name {k:?}"
                )));
            }
            let source = KeySource::parse(&v);
            let literal = matches!(source, KeySource::Literal);
            let value = match source {
                KeySource::Literal => v.clone(),
                _ => match source.resolve(&v, fetched) {
                    Ok(s) => s.expose().to_string(),
                    Err(problem) => {
                        warnings.push(format!("{at}.headers.{k}: {problem}"));
                        continue;
                    }
                },
            };
            if !literal || credential_header(&k) {
                header_secrets.extend(secret_parts(&value).map(|s| Secret::new(s.to_string())));
            }
            headers.push((k, Secret::new(value)));
        }
        if let Some((user, pass)) = basic {
            if !specs.is_empty()
                || headers
                    .iter()
                    .any(|(k, _)| k.eq_ignore_ascii_case("authorization"))
            {
                return Err(ConfigError(format!(
                    "at `{at}.base_url`: the URL's user and password would be sent as `Authorization: Basic`, which `api_key` or `headers.Authorization` sets too: give one of them"
                )));
            }
            use base64::Engine as _;
            let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
            let value = format!("Basic {token}");
            header_secrets.extend(secret_parts(&value).map(|s| Secret::new(s.to_string())));
            // The password as written, or a token given as the user name alone.
            let bare = if pass.is_empty() { user } else { pass };
            if bare.len() >= 4 {
                header_secrets.push(Secret::new(bare));
            }
            headers.push(("authorization".to_string(), Secret::new(value)));
        }
        let upstream_model = ep.model.unwrap_or_else(|| name.clone());
        // What the endpoint *is*: a retirement (410) is about the model at this address, not
        // about the key, so keys are tracked separately (by value hash, see `ApiKey::hash`).
        // A discovered endpoint is another server than a static one at the same base URL: the
        // marker changes its fingerprint (static ones keep theirs, and their stored retirements).
        // An endpoint of several addresses is the same one as they come and go.
        let fingerprint = format!(
            "{}|{}|{}{}",
            ep.kind,
            if addresses.is_empty() {
                base_url.as_str()
            } else {
                "base_urls"
            },
            upstream_model,
            if ep.discover.is_some() {
                "|discover"
            } else {
                ""
            }
        );
        let tls = match &ep.ca_file {
            None => tls_config(None).map_err(|e| ConfigError(format!("at `{at}`: {e}")))?,
            Some(path) => {
                // A CA bundle is a few hundred KB at most (the whole Mozilla store: ~220 KB).
                let pem = read_bounded(path.as_ref(), 4 * 1024 * 1024).map_err(|e| {
                    ConfigError(format!("at `{at}.ca_file`: cannot read {path}: {e}"))
                })?;
                tls_config(Some(&pem))
                    .map_err(|e| ConfigError(format!("at `{at}.ca_file`: {path}: {e}")))?
            }
        };
        let direct = direct_client(&tls, timeouts.connect);
        let plain_connector = timed_connector(&tls, timeouts.connect);
        let client = reqwest::Client::builder().use_preconfigured_tls(tls);
        let client = client
            .connect_timeout(timeouts.connect)
            .pool_idle_timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| ConfigError(format!("at `{at}`: cannot build HTTP client: {e}")))?;
        let counter = match (&ep.tokenizer, &ep.encoding) {
            (Some(path), _) => {
                let path = std::path::PathBuf::from(path);
                let tok = crate::tokens::load_hf(&path)
                    .map_err(|e| ConfigError(format!("at `{at}.tokenizer`: {e}")))?;
                crate::tokens::Counter::Hf { path, tok }
            }
            (None, Some(enc)) => match enc.as_str() {
                "o200k_base" => crate::tokens::Counter::Tiktoken(crate::tokens::Family::O200k),
                "cl100k_base" => crate::tokens::Counter::Tiktoken(crate::tokens::Family::Cl100k),
                other => {
                    return Err(ConfigError(format!(
                        "at `{at}.encoding`: unknown encoding {other:?} (o200k_base or cl100k_base)"
                    )));
                }
            },
            (None, None) => match crate::tokens::family_for_model(&upstream_model) {
                Some(f) => crate::tokens::Counter::Tiktoken(f),
                None => crate::tokens::Counter::Estimate,
            },
        };
        let mut urls = Vec::with_capacity(Op::ALL.len());
        for op in Op::ALL {
            let u = url_for(ep.kind, &base_url, op);
            urls.push(
                reqwest::Url::parse(&u)
                    .map_err(|e| ConfigError(format!("at `{at}.base_url`: invalid URL: {e}")))?,
            );
        }
        let uris = urls
            .iter()
            .map(|u| u.as_str().parse::<http::Uri>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ConfigError(format!("at `{at}.base_url`: invalid URL: {e}")))?;
        let urls: [reqwest::Url; Op::ALL.len()] = urls
            .try_into()
            .map_err(|_| ConfigError(format!("at `{at}`: internal URL table error")))?;
        let uris: [http::Uri; Op::ALL.len()] = uris
            .try_into()
            .map_err(|_| ConfigError(format!("at `{at}`: internal URL table error")))?;
        let capabilities: BTreeSet<Capability> = ep
            .capabilities
            .map(|c| c.into_iter().collect())
            .unwrap_or_else(|| default_capabilities(ep.kind));
        endpoints.insert(
            name.clone(),
            Arc::new(Endpoint {
                name: name.clone(),
                name_header: http::HeaderValue::from_str(&name).ok(),
                kind: ep.kind,
                base_url,
                addresses,
                upstream_model,
                keys,
                context_window: ep.context_window,
                max_tokens: ep.max_tokens,
                timeouts,
                caps: capabilities.iter().copied().collect(),
                capabilities,
                retries: ep.retries.unwrap_or(0),
                retry_backoff: or_default(ep.retry_backoff, Duration::from_millis(100)),
                cooldown: ep.cooldown.map(|d| d.0),
                cost: ep.cost.unwrap_or_default(),
                headers,
                header_secrets,
                fingerprint,
                client,
                plain: plain(plain_connector, direct.is_some(), &uris),
                direct,
                urls,
                uris,
                counter,
                on_context_overflow: ep.on_context_overflow,
                payload_hygiene: ep.payload_hygiene.unwrap_or_default(),
                backend_tokenize: ep.backend_tokenize.map(|b| {
                    (
                        b,
                        or_default(ep.tokenize_timeout, Duration::from_millis(300)),
                    )
                }),
                tokenize_cache: Default::default(),
                discover: ep.discover.is_some(),
                // Its defaults written in, so the table says what the prober does.
                health_check: ep.health_check.map(|mut hc| {
                    hc.kv_growth_probes.get_or_insert(5);
                    hc
                }),
                semantic_probe: ep.semantic_probe.unwrap_or(false),
                hedge: ep
                    .hedge
                    .as_ref()
                    .map(|h| hedge_spec(&format!("models.{name}.hedge"), h))
                    .transpose()?,
                balance: ep
                    .balance
                    .as_ref()
                    .map(|b| balance(&format!("{at}.balance"), b))
                    .transpose()?
                    .unwrap_or_default(),
            }),
        );
    }

    let p = raw.routing_policy;
    let mut fallback_chain = p.fallback_chain;
    if fallback_chain.is_empty() {
        // No chain given: every endpoint, in name order, so the gateway still fails over.
        fallback_chain = endpoints.keys().cloned().collect();
    }
    check_chain("routing_policy.fallback_chain", &fallback_chain, &endpoints)?;
    let mut routes = BTreeMap::new();
    let mut route_overflow = BTreeMap::new();
    let mut route_hedge = BTreeMap::new();
    let mut route_continue = BTreeSet::new();
    for (route, r) in raw.routes {
        if let RawRoute::Full(f) = &r
            && (f.last_resort.is_some() || f.cache.is_some())
        {
            let mut spec = match &f.last_resort {
                Some(l) => last_resort_spec(&format!("routes.{route}.last_resort"), l)?,
                None => {
                    let mut s = last_resort_spec("", &super::raw::RawLastResort::default())?;
                    s.last_resort = None;
                    s
                }
            };
            if let Some(c) = &f.cache {
                let at = format!("routes.{route}.cache");
                let ttl = c.ttl.map_or(Duration::from_secs(300), |d| d.0);
                if !(Duration::from_secs(1)..=Duration::from_secs(30 * 86_400)).contains(&ttl) {
                    return Err(ConfigError(format!("at `{at}.ttl`: 1s to 30d")));
                }
                spec.cache = Some(super::types::CacheSpec {
                    ttl,
                    temperature_absent: c.temperature_absent.unwrap_or(false),
                });
                spec.ttl = match spec.last_resort {
                    Some(l) => l.max(ttl),
                    None => ttl,
                };
            }
            last_resort.insert(route.clone(), spec);
        }
        match r {
            RawRoute::Chain(c) => {
                routes.insert(route, c);
            }
            RawRoute::Full(f) => {
                if let Some(o) = f.on_context_overflow {
                    route_overflow.insert(route.clone(), o);
                }
                if f.continue_streams == Some(true) {
                    route_continue.insert(route.clone());
                }
                if let Some(h) = &f.hedge {
                    route_hedge.insert(
                        route.clone(),
                        hedge_spec(&format!("routes.{route}.hedge"), h)?,
                    );
                }
                routes.insert(route, f.chain);
            }
        }
    }
    for (route, chain) in &routes {
        if endpoints.contains_key(route) {
            return Err(ConfigError(format!(
                "at `routes.{route}`: the route name is also an endpoint name; a request for it would be ambiguous"
            )));
        }
        if chain.is_empty() {
            return Err(ConfigError(format!(
                "at `routes.{route}`: the chain is empty"
            )));
        }
        check_chain(&format!("routes.{route}"), chain, &endpoints)?;
    }
    let success_threshold = p.success_threshold.unwrap_or(0.85);
    if !(0.0..=1.0).contains(&success_threshold) {
        return Err(ConfigError(
            "at `routing_policy.success_threshold`: must be between 0 and 1".into(),
        ));
    }
    let policy = Policy {
        success_threshold,
        cache_ttl: or_default(p.cache_ttl, Duration::from_secs(300)),
        max_wait: or_default(p.max_wait, Duration::ZERO),
        window: or_default(p.window, Duration::from_secs(300)),
        min_samples: p.min_samples.unwrap_or(10),
        default_cooldown: or_default(p.default_cooldown, Duration::from_secs(30)),
        context_fill: p.context_fill.unwrap_or(0.95),
        on_context_overflow: p.on_context_overflow.unwrap_or(Overflow::Reject),
        truncation: crate::tokens::truncate::Options {
            keep_turns: p.truncation.and_then(|t| t.keep_turns).unwrap_or(2),
            note: p.truncation.and_then(|t| t.omission_note).unwrap_or(true),
        },
        // Filled from `health:` below.
        health: crate::routing::health::Thresholds::default(),
        max_cooldown: or_default(p.max_cooldown, Duration::from_secs(600)),
        panic_threshold: p.panic_threshold.unwrap_or(0.5),
        request_timeout: or_default(p.request_timeout, Duration::from_secs(300)),
        slow_start: or_default(p.slow_start, Duration::from_secs(30)),
        predict_rate_limits: p.predict_rate_limits.unwrap_or(true),
    };
    if !(0.0..=1.0).contains(&policy.panic_threshold) {
        return Err(ConfigError(
            "at `routing_policy.panic_threshold`: must be between 0 and 1".into(),
        ));
    }
    if policy.request_timeout.is_zero() {
        return Err(ConfigError(
            "at `routing_policy.request_timeout`: must be greater than zero".into(),
        ));
    }
    if !(policy.context_fill > 0.0 && policy.context_fill <= 1.0) {
        return Err(ConfigError(
            "at `routing_policy.context_fill`: must be in (0, 1]".into(),
        ));
    }
    if policy.window.is_zero() {
        return Err(ConfigError(
            "at `routing_policy.window`: must be greater than zero".into(),
        ));
    }
    let rh = &raw.health;
    let thresholds = crate::routing::health::Thresholds {
        flip_after: rh.flip_after.unwrap_or(2).max(1),
        warmup: or_default(rh.warmup, Duration::from_secs(180)),
        eject_after: rh.eject_after.unwrap_or(5).max(1),
        eject_base: or_default(rh.eject_base, Duration::from_secs(10)),
        eject_max: or_default(rh.eject_max, Duration::from_secs(300)),
    };
    let rd = raw.docker;
    let docker = DockerConfig {
        enabled: rd.enabled,
        interval: or_default(rd.interval, Duration::from_secs(5)).max(Duration::from_millis(200)),
        timeout: or_default(rd.timeout, Duration::from_secs(5)),
        network: rd.network,
        stack: rd.stack,
        adopt_unconfigured: rd.adopt_unconfigured,
        remediation: Remediation {
            enabled: rd.remediation.enabled,
            dry_run: rd.remediation.dry_run,
            unhealthy_after: rd.remediation.unhealthy_after.unwrap_or(3).max(1),
            min_interval: or_default(rd.remediation.min_interval, Duration::from_secs(60)),
            manage: rd.remediation.manage,
            standby: rd
                .remediation
                .standby
                .into_iter()
                .map(|s| Standby {
                    primary: s.primary,
                    service: s.service,
                    healthy_for: or_default(s.healthy_for, Duration::from_secs(60)),
                })
                .collect(),
        },
    };
    for (i, sb) in docker.remediation.standby.iter().enumerate() {
        if !endpoints.contains_key(&sb.primary) {
            return Err(ConfigError(format!(
                "at `docker.remediation.standby[{i}].primary`: unknown endpoint {:?}",
                sb.primary
            )));
        }
    }
    if let Some(ep) = endpoints.values().find(|e| e.discover)
        && !docker.enabled
    {
        return Err(ConfigError(format!(
            "at `models.{}.discover`: discovery needs `docker: {{ enabled: true }}`",
            ep.name
        )));
    }
    // Zero would close every connection before its first byte (header), refuse every body, or
    // cut every response that waits a moment for the client: no gateway at all.
    for (what, d) in [
        ("header_timeout", raw.server.header_timeout),
        ("body_timeout", raw.server.body_timeout),
        ("send_timeout", raw.server.send_timeout),
    ] {
        if d.is_some_and(|d| d.0.is_zero()) {
            return Err(ConfigError(format!(
                "at `server.{what}`: must be greater than zero"
            )));
        }
    }
    let health = HealthPolicy {
        probe_interval: or_default(raw.health.probe_interval, Duration::from_secs(15))
            .max(Duration::from_millis(100)),
        probe_timeout: or_default(raw.health.probe_timeout, Duration::from_secs(2)),
        vllm_max_waiting: raw.health.vllm_max_waiting.unwrap_or(16.0),
        vllm_max_kv_cache: raw.health.vllm_max_kv_cache.unwrap_or(0.95),
    };
    let listen = raw
        .server
        .listen
        .unwrap_or_else(|| "127.0.0.1:8000".to_string());
    if auth.keys.is_none() && !listen_is_loopback(&listen) {
        warnings.push(format!(
            "server.listen is {listen}, not loopback, and `auth.keys` is not set: anyone who reaches this address can spend the upstream keys"
        ));
    }
    let max_event_bytes = match raw.limits.max_event_bytes.map(|b| byte_count(b.0)) {
        None => DEFAULT_MAX_EVENT_BYTES,
        Some(n) if n >= 1024 => n,
        Some(_) => {
            return Err(ConfigError(
                "at `limits.max_event_bytes`: at least 1024 (one chunk of a stream is a few hundred bytes)".into(),
            ));
        }
    };
    let allowed_hosts = match raw.server.allowed_hosts {
        None => None,
        Some(list) => {
            let mut names = Vec::with_capacity(list.len());
            for (i, h) in list.into_iter().enumerate() {
                let h = h.trim().trim_end_matches('.').to_ascii_lowercase();
                if h.is_empty() || h.contains(['/', ' ', '@']) {
                    return Err(ConfigError(format!(
                        "at `server.allowed_hosts[{i}]`: a host name, `.name` (it and the names under it) or `*`"
                    )));
                }
                names.push(h);
            }
            Some(names)
        }
    };
    let responses = {
        let d = ResponsesSettings::default();
        let total = raw
            .responses
            .history_max_bytes
            .map_or(d.history_max_bytes, |b| b.0);
        ResponsesSettings {
            keep_history: raw.responses.history == Some(super::raw::HistoryMode::Keep),
            history_ttl: raw.responses.history_ttl.map_or(d.history_ttl, |t| t.0),
            history_max_bytes: total,
            history_max_bytes_per_key: raw
                .responses
                .history_max_bytes_per_key
                .map_or(total / 4, |b| b.0)
                .min(total),
        }
    };
    let mut cfg = Config {
        audit_pg,
        responses,
        listen,
        max_body_bytes: raw
            .server
            .max_body_bytes
            .map_or(DEFAULT_MAX_BODY, |b| byte_count(b.0)),
        max_response_bytes: raw
            .server
            .max_response_bytes
            .map_or(DEFAULT_MAX_RESPONSE, |b| byte_count(b.0))
            .max(1),
        audit_queue: raw.server.audit_queue.unwrap_or(10_000).max(1),
        audit_retention: match raw.server.audit_retention {
            Some(d) if d.0.is_zero() => None,
            Some(d) => Some(d.0),
            None => Some(Duration::from_secs(30 * 86_400)),
        },
        capture_bodies: raw
            .audit
            .as_ref()
            .and_then(|a| a.capture_bodies)
            .unwrap_or_default(),
        capture_max_bytes: match raw.audit.as_ref().and_then(|a| a.max_body_bytes) {
            None => DEFAULT_CAPTURE_MAX_BYTES,
            Some(b) if (1 << 10..=16 << 20).contains(&b.0) => b.0 as usize,
            Some(_) => {
                return Err(ConfigError(
                    "at `audit.max_body_bytes`: 1KiB to 16MiB".into(),
                ));
            }
        },
        shutdown_grace: or_default(raw.server.shutdown_grace, Duration::from_secs(30)),
        drain_delay: or_default(raw.server.drain_delay, Duration::from_secs(5)),
        header_timeout: or_default(raw.server.header_timeout, Duration::from_secs(10)),
        body_timeout: or_default(raw.server.body_timeout, Duration::from_secs(30)),
        send_timeout: or_default(raw.server.send_timeout, Duration::from_secs(60)),
        // Envoy's circuit breaker allows 1,024 requests per cluster by default; one process
        // serving many teams gets four times that, and none may take every socket and byte.
        max_concurrent_requests: raw.server.max_concurrent_requests.unwrap_or(4096),
        max_event_bytes,
        allowed_hosts,
        endpoints,
        fallback_chain,
        routes,
        chains: BTreeMap::new(),
        route_overflow,
        route_hedge,
        route_continue,
        last_resort,
        auth,
        vault,
        vault_digest,
        policy: Policy {
            health: thresholds,
            ..policy
        },
        health,
        docker,
        source: Source::None,
        source_digest: [0; 32],
        discovered_extra: Vec::new(),
        alerts,
        cluster,
        otlp,
        warnings,
    };
    cfg.chains = cfg.resolve_chains();
    Ok(cfg)
}

/// `telemetry.otlp:` → its settings. Header values are secrets: errors name their source.
fn otlp(
    raw: Option<&RawOtlp>,
    fetched: &Fetched,
) -> Result<Option<Arc<OtlpSettings>>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let mut endpoint = reqwest::Url::parse(raw.endpoint.trim())
        .map_err(|e| ConfigError(format!("at `telemetry.otlp.endpoint`: not a URL: {e}")))?;
    if !matches!(endpoint.scheme(), "http" | "https") || endpoint.host_str().is_none() {
        return Err(ConfigError(
            "at `telemetry.otlp.endpoint`: an http:// or https:// URL with a host".into(),
        ));
    }
    if matches!(endpoint.path(), "" | "/") {
        endpoint.set_path("/v1/traces");
    }
    let mut display = endpoint.clone();
    let _ = display.set_username("");
    let _ = display.set_password(None);
    display.set_query(None);
    let mut headers = Vec::new();
    for (k, v) in raw.headers.iter().flatten() {
        let name = k.trim().to_ascii_lowercase();
        if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(ConfigError(format!(
                "at `telemetry.otlp.headers`: `{}` is not a header name",
                k.escape_debug()
            )));
        }
        let value = required(&format!("telemetry.otlp.headers.{name}"), v, fetched)?;
        if http::HeaderValue::from_str(value.expose()).is_err() {
            return Err(ConfigError(format!(
                "at `telemetry.otlp.headers.{name}` ({}): not a valid header value",
                KeySource::parse(v)
            )));
        }
        headers.push((name, value));
    }
    let sample_ratio = raw.sample_ratio.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&sample_ratio) {
        return Err(ConfigError(
            "at `telemetry.otlp.sample_ratio`: between 0 and 1".into(),
        ));
    }
    let service_name = raw
        .service_name
        .clone()
        .unwrap_or_else(|| "autohedge".into());
    if service_name.is_empty()
        || service_name.len() > 128
        || service_name.chars().any(char::is_control)
    {
        return Err(ConfigError(
            "at `telemetry.otlp.service_name`: 1 to 128 characters, no control characters".into(),
        ));
    }
    let max_queue_spans = raw.max_queue_spans.unwrap_or(4096);
    if !(1..=1_000_000).contains(&max_queue_spans) {
        return Err(ConfigError(
            "at `telemetry.otlp.max_queue_spans`: 1 to 1000000".into(),
        ));
    }
    let max_queue_bytes = raw.max_queue_bytes.map_or(32 << 20, |b| b.0);
    if !((1 << 20)..=(4u64 << 30)).contains(&max_queue_bytes) {
        return Err(ConfigError(
            "at `telemetry.otlp.max_queue_bytes`: 1MiB to 4GiB".into(),
        ));
    }
    Ok(Some(Arc::new(OtlpSettings {
        endpoint,
        display: display.to_string(),
        headers,
        sample_ratio,
        service_name,
        capture_content: raw.capture_content.unwrap_or(false),
        max_queue_spans,
        max_queue_bytes: usize::try_from(max_queue_bytes).unwrap_or(usize::MAX),
    })))
}

/// `cluster:` → its settings. The URL is a secret (it may hold a password): errors name its
/// source, never its value.
fn cluster(
    raw: Option<&RawCluster>,
    fetched: &Fetched,
) -> Result<Option<ClusterSettings>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let url = required("cluster.redis", &raw.redis, fetched)?;
    let source = KeySource::parse(&raw.redis);
    let display = cluster_display(url.expose()).ok_or_else(|| {
        ConfigError(format!(
            "at `cluster.redis` ({source}): not a redis:// or rediss:// URL"
        ))
    })?;
    let key_prefix = raw
        .key_prefix
        .clone()
        .unwrap_or_else(|| "autohedge:".to_string());
    if key_prefix.len() > 128 || key_prefix.chars().any(|c| c.is_control() || c == ' ') {
        return Err(ConfigError(
            "at `cluster.key_prefix`: at most 128 characters, no spaces or control characters"
                .into(),
        ));
    }
    let timeout = or_default(raw.timeout, Duration::from_millis(25));
    if timeout.is_zero() || timeout > Duration::from_secs(10) {
        return Err(ConfigError(
            "at `cluster.timeout`: more than 0 and at most 10s".into(),
        ));
    }
    let replicas = match raw.replicas {
        Some(n) if !(1..=10_000).contains(&n) => {
            return Err(ConfigError("at `cluster.replicas`: 1 to 10000".into()));
        }
        n => n,
    };
    Ok(Some(ClusterSettings {
        url,
        display,
        key_prefix,
        timeout,
        replicas,
    }))
}

/// `audit:` → where the trail goes: `None` for SQLite (the default), else PostgreSQL's URL
/// (checked here: a URL tokio-postgres reads, without TLS, which is not built in) and pool.
fn audit_pg(raw: Option<&RawAudit>, fetched: &Fetched) -> Result<Option<PgSettings>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    match (raw.store.unwrap_or(AuditStoreKind::Sqlite), &raw.url) {
        (AuditStoreKind::Sqlite, None) => return Ok(None),
        (AuditStoreKind::Sqlite, Some(_)) => {
            return Err(ConfigError(
                "at `audit.url`: only with `audit.store: postgres` (SQLite lives in --data-dir)"
                    .into(),
            ));
        }
        (AuditStoreKind::Postgres, None) => {
            return Err(ConfigError(
                "at `audit.url`: required with `audit.store: postgres`".into(),
            ));
        }
        (AuditStoreKind::Postgres, Some(_)) => {}
    }
    let spec = raw.url.as_deref().unwrap_or_default();
    let url = required("audit.url", spec, fetched)?;
    let source = KeySource::parse(spec);
    let parsed: tokio_postgres::Config = url.expose().parse().map_err(|_| {
        ConfigError(format!(
            "at `audit.url` ({source}): not a postgres:// URL or key=value connection string"
        ))
    })?;
    if parsed.get_ssl_mode() == tokio_postgres::config::SslMode::Require {
        return Err(ConfigError(format!(
            "at `audit.url` ({source}): sslmode=require, but TLS to PostgreSQL is not built in (use sslmode=disable over a private network or a local socket)"
        )));
    }
    let host = parsed
        .get_hosts()
        .first()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .unwrap_or_else(|| "localhost".into());
    let port = parsed.get_ports().first().copied().unwrap_or(5432);
    let display = format!(
        "postgres://{}@{host}:{port}/{}",
        parsed.get_user().unwrap_or(""),
        parsed.get_dbname().unwrap_or("")
    );
    let pool = raw.pool.unwrap_or(8);
    if !(1..=256).contains(&pool) {
        return Err(ConfigError("at `audit.pool`: 1 to 256".into()));
    }
    let spool_max_bytes = raw.spool_max_bytes.map_or(DEFAULT_SPOOL_MAX_BYTES, |b| b.0);
    Ok(Some(PgSettings {
        url,
        display,
        pool,
        spool_max_bytes,
    }))
}

/// `alerts:` → `Alerts`. A webhook whose `env:`/`file:` cannot be read is left out with a
/// warning (the gateway serves on); a URL that is not http(s) or an unknown event is an error
/// that names where, never the URL.
fn alerts(
    raw: Option<&RawAlerts>,
    fetched: &Fetched,
    warnings: &mut Vec<String>,
) -> Result<Option<Alerts>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let mut webhooks = Vec::new();
    for (i, w) in raw.webhooks.iter().enumerate() {
        let at = format!("alerts.webhooks[{i}]");
        let format = match w.format.as_deref() {
            None | Some("json") => WebhookFormat::Json,
            Some("slack") => WebhookFormat::Slack,
            Some(other) => {
                return Err(ConfigError(format!(
                    "at `{at}.format`: unknown format `{}` (slack | json)",
                    other.chars().take(40).collect::<String>()
                )));
            }
        };
        let source = KeySource::parse(&w.url);
        let url = match source.resolve(&w.url, fetched) {
            Ok(u) => u,
            Err(problem) => {
                warnings.push(format!(
                    "{at}.url ({source}): {problem}; this webhook is off"
                ));
                continue;
            }
        };
        let parsed = reqwest::Url::parse(url.expose().trim())
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some());
        let Some(parsed) = parsed else {
            return Err(ConfigError(format!(
                "at `{at}.url` ({source}): not an http(s) URL"
            )));
        };
        let label = format!(
            "{}://{}{}",
            parsed.scheme(),
            parsed.host_str().unwrap_or_default(),
            parsed.port().map(|p| format!(":{p}")).unwrap_or_default()
        );
        webhooks.push(Webhook {
            url: Secret::new(parsed.to_string()),
            format,
            label,
        });
    }
    let events = match &raw.events {
        None => AlertEvent::ALL.into_iter().collect(),
        Some(list) => {
            let mut set = BTreeSet::new();
            for (i, name) in list.iter().enumerate() {
                let Some(e) = AlertEvent::parse(name) else {
                    return Err(ConfigError(format!(
                        "at `alerts.events[{i}]`: unknown event `{}` (one of: {})",
                        name.chars().take(40).collect::<String>(),
                        AlertEvent::ALL.map(AlertEvent::as_str).join(", ")
                    )));
                };
                set.insert(e);
            }
            set
        }
    };
    let (count, window) = match &raw.all_failed {
        Some(a) if a.window.0.is_zero() => {
            return Err(ConfigError(
                "at `alerts.all_failed.window`: must be longer than 0".into(),
            ));
        }
        Some(a) => (a.count, a.window.0),
        None => (10, Duration::from_secs(60)),
    };
    Ok(Some(Alerts {
        webhooks,
        events,
        all_failed_count: count,
        all_failed_window: window,
        repeat: raw.repeat.map(|d| d.0).unwrap_or(Duration::from_secs(300)),
    }))
}

fn check_chain(
    at: &str,
    chain: &[String],
    endpoints: &BTreeMap<String, Arc<Endpoint>>,
) -> Result<(), ConfigError> {
    let mut seen = BTreeSet::new();
    for (i, name) in chain.iter().enumerate() {
        if !endpoints.contains_key(name) {
            return Err(ConfigError(format!(
                "at `{at}[{i}]`: unknown endpoint {name:?} (defined under `models`: {})",
                endpoints.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        if !seen.insert(name) {
            return Err(ConfigError(format!(
                "at `{at}[{i}]`: {name:?} is listed twice"
            )));
        }
    }
    Ok(())
}

/// `hedge:` as the executor reads it.
fn hedge_spec(at: &str, h: &RawHedge) -> Result<crate::routing::hedge::Spec, ConfigError> {
    use crate::routing::hedge::{After, Spec, parse_percentile, parse_share};
    let after = match &h.after {
        StrOrNum::Num(n) => After::Fixed(
            duration::parse_duration(&n.to_string())
                .map_err(|e| ConfigError(format!("at `{at}.after`: {e}")))?,
        ),
        StrOrNum::Str(s) if s.trim_start().starts_with('p') => {
            After::Percentile(parse_percentile(s).ok_or_else(|| {
                ConfigError(format!(
                    "at `{at}.after`: a percentile is written p90, p95 or p99 (between p0 and p100)"
                ))
            })?)
        }
        StrOrNum::Str(s) => After::Fixed(duration::parse_duration(s).map_err(|e| {
            ConfigError(format!("at `{at}.after`: {e}; or a percentile such as p95"))
        })?),
    };
    let max_extra = match &h.max_extra {
        None => 0.05,
        Some(v) => {
            let text = match v {
                StrOrNum::Num(n) => n.to_string(),
                StrOrNum::Str(s) => s.clone(),
            };
            parse_share(&text).ok_or_else(|| {
                ConfigError(format!(
                    "at `{at}.max_extra`: a share of the requests between 0% and 100% (5% or 0.05)"
                ))
            })?
        }
    };
    Ok(Spec {
        after,
        max_extra,
        min_after: or_default(h.min_after, Duration::from_millis(50)),
        tools: h.tools.unwrap_or(false),
    })
}

/// `audit.max_body_bytes`' default: enough for a long RAG prompt; a longer body is cut (and a
/// cut request is not replayed).
const DEFAULT_CAPTURE_MAX_BYTES: usize = 256 << 10;

/// `audit.spool_max_bytes`' default: what waits in the data dir while PostgreSQL is away.
pub const DEFAULT_SPOOL_MAX_BYTES: u64 = 1 << 30;

/// `models.<name>.balance`: a strategy's name, or a map of the knobs.
fn balance(at: &str, v: &serde_json::Value) -> Result<Balance, ConfigError> {
    use serde_json::Value;
    let strategy = |at: &str, v: &Value| match v.as_str() {
        Some("least_loaded") => Ok(false),
        Some("random") => Ok(true),
        _ => Err(ConfigError(format!(
            "at `{at}`: `least_loaded` or `random`, not {}",
            clip_value(v)
        ))),
    };
    let mut b = Balance::default();
    // `random` is the balance of old: any usable address, no conversation kept anywhere
    // (unless `affinity` says otherwise).
    let mut affinity_set = false;
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let at = format!("{at}.{k}");
                let number = |lo: f64, hi: f64| {
                    v.as_f64()
                        .filter(|x| x.is_finite() && (lo..=hi).contains(x))
                        .ok_or_else(|| {
                            ConfigError(format!(
                                "at `{at}`: a number from {lo} to {hi}, not {}",
                                clip_value(v)
                            ))
                        })
                };
                match k.as_str() {
                    "strategy" => b.random = strategy(&at, v)?,
                    "affinity" => {
                        affinity_set = true;
                        b.affinity = match v.as_str() {
                            Some("prefix") => true,
                            Some("none") => false,
                            _ => {
                                return Err(ConfigError(format!(
                                    "at `{at}`: `prefix` or `none`, not {}",
                                    clip_value(v)
                                )));
                            }
                        }
                    }
                    "affinity_load" => b.affinity_load = number(1.0, 100.0)?,
                    "max_ejection_percent" => b.max_ejection_percent = number(0.0, 100.0)?,
                    _ => {
                        return Err(ConfigError(format!(
                            "at `{at}`: unknown key (`strategy`, `affinity`, `affinity_load`, `max_ejection_percent`)"
                        )));
                    }
                }
            }
        }
        v => b.random = strategy(at, v)?,
    }
    if b.random && !affinity_set {
        b.affinity = false;
    }
    Ok(b)
}

/// A value as an error message shows it: at most 60 characters of its JSON.
fn clip_value(v: &serde_json::Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// The most addresses one endpoint may list (`base_urls`): each is a `/status` entry and a
/// metrics label.
pub const MAX_ADDRESSES: usize = 64;

/// A configured size as a count of bytes this machine can hold (a larger one is all of them:
/// a limit nobody reaches).
fn byte_count(b: u64) -> usize {
    usize::try_from(b).unwrap_or(usize::MAX)
}

/// `limits.max_event_bytes`' default: a chunk of an LLM stream is a few hundred bytes; a whole
/// tool call's arguments or a logprobs block fit many times over.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// True for `127.0.0.1:…`, `[::1]:…` and `localhost:…`.
pub fn listen_is_loopback(listen: &str) -> bool {
    let host = listen
        .rsplit_once(':')
        .map_or(listen, |(h, _)| h)
        .trim_matches(|c| c == '[' || c == ']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Every `vault:` secret the file names (keys, header values, client keys, the admin key).
pub(super) fn vault_refs(raw: &RawConfig) -> Vec<crate::config::vault::Ref> {
    let mut specs: Vec<&str> = Vec::new();
    for ep in raw.models.values() {
        specs.extend(ep.api_key.as_deref());
        specs.extend(ep.api_keys.iter().flatten().map(String::as_str));
        specs.extend(ep.headers.iter().flatten().map(|(_, v)| v.as_str()));
    }
    specs.extend(raw.auth.admin_key.as_deref());
    specs.extend(raw.cluster.as_ref().map(|c| c.redis.as_str()));
    specs.extend(
        raw.telemetry
            .otlp
            .iter()
            .flat_map(|o| o.headers.iter().flatten())
            .map(|(_, v)| v.as_str()),
    );
    specs.extend(raw.audit.as_ref().and_then(|a| a.url.as_deref()));
    specs.extend(raw.auth.keys.iter().flatten().map(|k| k.key.as_str()));
    let mut refs: Vec<crate::config::vault::Ref> = specs
        .into_iter()
        .filter_map(|s| s.strip_prefix("vault:"))
        .filter_map(|r| crate::config::vault::Ref::parse(r).ok())
        .collect();
    refs.sort();
    refs.dedup();
    refs
}

/// A secret spec that must resolve (the admin key, Vault's own credentials): `env:`, `file:` or a
/// literal. The error names the source, never a value.
fn required(at: &str, spec: &str, fetched: &Fetched) -> Result<Secret, ConfigError> {
    let source = KeySource::parse(spec);
    source
        .resolve(spec, fetched)
        .map_err(|p| ConfigError(format!("at `{at}` ({source}): {p}")))
}

pub(super) fn vault_settings(v: &RawVault) -> Result<crate::config::vault::Settings, ConfigError> {
    use crate::config::vault::{Login, Settings};
    let none = Fetched::new();
    reqwest::Url::parse(&v.address)
        .map_err(|e| ConfigError(format!("at `vault.address`: invalid URL: {e}")))?;
    let login = match (&v.token, &v.approle) {
        (Some(_), Some(_)) => {
            return Err(ConfigError(
                "at `vault`: give either `token` or `approle`, not both".into(),
            ));
        }
        (Some(t), None) => Login::Token(zeroize::Zeroizing::new(
            required("vault.token", t, &none)?.expose().to_string(),
        )),
        (None, Some(a)) => Login::AppRole {
            mount: a.mount.clone().unwrap_or_else(|| "approle".into()),
            role_id: a.role_id.clone(),
            secret_id: zeroize::Zeroizing::new(
                required("vault.approle.secret_id", &a.secret_id, &none)?
                    .expose()
                    .to_string(),
            ),
        },
        (None, None) => {
            return Err(ConfigError(
                "at `vault`: give `token` (env:VAULT_TOKEN) or `approle`".into(),
            ));
        }
    };
    Ok(Settings {
        address: v.address.trim_end_matches('/').to_string(),
        login,
        namespace: v.namespace.clone().filter(|n| !n.is_empty()),
        refresh: or_default(v.refresh, Duration::from_secs(300)),
        transit_key: v.transit_key.clone().filter(|k| !k.is_empty()),
        transit_mount: v.transit_mount.clone().unwrap_or_else(|| "transit".into()),
        cache_ttl: or_default(v.cache_ttl, Duration::from_secs(60)),
        timeout: or_default(v.timeout, Duration::from_secs(5)),
    })
}

/// `auth:` as digests: `sha256:<hex>` is taken as the digest itself; any other source is read
/// and hashed, and only the digest is kept.
fn auth(
    raw: &RawAuth,
    models: &BTreeMap<String, RawEndpoint>,
    routes: &BTreeMap<String, RawRoute>,
    fetched: &Fetched,
    warnings: &mut Vec<String>,
) -> Result<Auth, ConfigError> {
    let digest_of = |at: &str, spec: &str| -> Result<[u8; 32], ConfigError> {
        if let Some(hex) = spec.strip_prefix("sha256:") {
            return parse_digest(hex.trim()).ok_or_else(|| {
                ConfigError(format!(
                    "at `{at}`: sha256: takes the 64 hex digits of a key's SHA-256"
                ))
            });
        }
        let secret = required(at, spec, fetched)?;
        Ok(key_digest(secret.expose()))
    };
    let (admin, admin_locked) = match raw.admin_key.as_deref() {
        None => (None, false),
        Some(s) if s.starts_with("sha256:") => (Some(digest_of("auth.admin_key", s)?), false),
        Some(s) => match digest_of("auth.admin_key", s) {
            Ok(d) => (Some(d), false),
            Err(e) => {
                warnings.push(format!(
                    "{} (the admin surface is closed until it can be read)",
                    e.0
                ));
                (None, true)
            }
        },
    };
    let keys = match &raw.keys {
        None => None,
        Some(list) if list.is_empty() => {
            return Err(ConfigError(
                "at `auth.keys`: the list is empty (remove it to turn client keys off)".into(),
            ));
        }
        Some(list) => {
            let mut out: Vec<ClientKey> = Vec::new();
            for (i, k) in list.iter().enumerate() {
                let at = format!("auth.keys[{i}]");
                if k.name.trim().is_empty() {
                    return Err(ConfigError(format!("at `{at}.name`: must not be empty")));
                }
                if out.iter().any(|o| o.name == k.name) {
                    return Err(ConfigError(format!(
                        "at `{at}.name`: {:?} is used twice",
                        k.name
                    )));
                }
                let digest = match digest_of(&format!("{at}.key"), &k.key) {
                    Ok(d) => d,
                    Err(e) if !k.key.starts_with("sha256:") => {
                        // An unset env var or unreadable file: that client is locked out, the
                        // others are served.
                        warnings.push(format!("{} (client `{}` cannot authenticate)", e.0, k.name));
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                if out.iter().any(|o| o.digest == digest) {
                    return Err(ConfigError(format!(
                        "at `{at}.key`: the same key as another client"
                    )));
                }
                if let Some(models_allowed) = &k.models {
                    for (j, m) in models_allowed.iter().enumerate() {
                        if !models.contains_key(m) && !routes.contains_key(m) {
                            return Err(ConfigError(format!(
                                "at `{at}.models[{j}]`: {m:?} is neither a route nor an endpoint"
                            )));
                        }
                    }
                }
                if k.rpm == Some(0) || k.tpm == Some(0) {
                    return Err(ConfigError(format!(
                        "at `{at}`: rpm and tpm must be greater than zero (leave them out for no limit)"
                    )));
                }
                if k.budget_usd.is_some_and(|b| !b.is_finite() || b < 0.0) {
                    return Err(ConfigError(format!(
                        "at `{at}.budget_usd`: must be a non-negative number"
                    )));
                }
                out.push(ClientKey {
                    name: k.name.clone(),
                    digest,
                    models: k.models.as_ref().map(|m| m.iter().cloned().collect()),
                    rpm: k.rpm,
                    tpm: k.tpm,
                    budget_usd: k.budget_usd,
                });
            }
            Some(out)
        }
    };
    Ok(Auth {
        admin,
        admin_locked,
        keys,
    })
}

/// The SHA-256 of a client or admin key: the only form the gateway keeps.
pub fn key_digest(key: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes()).into()
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A URL's user name or password as written, percent-decoded (`p%40ss` is `p@ss`).
fn percent_decoded(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether a header's name says its value is a credential (`authorization`, `api-key`,
/// `x-goog-api-key`, `x-auth-token`, a cookie...).
fn credential_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "auth",
        "key",
        "token",
        "secret",
        "cookie",
        "password",
        "signature",
    ]
    .iter()
    .any(|w| name.contains(w))
}

/// What of a credential header's value is secret: the value, and for `Bearer x` or `Basic x`
/// the token alone too (an upstream may quote either).
fn secret_parts(value: &str) -> impl Iterator<Item = &str> {
    let token = value
        .split_once(' ')
        .map(|(_, t)| t.trim())
        .filter(|t| !t.is_empty());
    std::iter::once(value.trim()).chain(token)
}

/// `last_resort:` at `at`, checked: a ttl from 1s to 30 days, bytes from 64KiB to 64GiB, a key's
/// share no more than the whole.
fn last_resort_spec(
    at: &str,
    l: &super::raw::RawLastResort,
) -> Result<super::types::LastResortSpec, ConfigError> {
    let ttl = l.ttl.map_or(Duration::from_secs(86_400), |d| d.0);
    if !(Duration::from_secs(1)..=Duration::from_secs(30 * 86_400)).contains(&ttl) {
        return Err(ConfigError(format!("at `{at}.ttl`: 1s to 30d")));
    }
    let max_bytes = l.max_bytes.map_or(256 << 20, |b| b.0);
    if !((64 << 10)..=(64u64 << 30)).contains(&max_bytes) {
        return Err(ConfigError(format!("at `{at}.max_bytes`: 64KiB to 64GiB")));
    }
    let max_bytes_per_key = l.max_bytes_per_key.map_or(max_bytes / 4, |b| b.0);
    if max_bytes_per_key == 0 || max_bytes_per_key > max_bytes {
        return Err(ConfigError(format!(
            "at `{at}.max_bytes_per_key`: more than 0, at most `max_bytes`"
        )));
    }
    Ok(super::types::LastResortSpec {
        ttl,
        max_bytes,
        max_bytes_per_key,
        shared: l.shared.unwrap_or(false),
        last_resort: Some(ttl),
        cache: None,
    })
}
