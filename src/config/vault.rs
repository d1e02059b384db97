//! Vault (or OpenBao: the same HTTP API) through the `vaultrs` crate: KV version 2 reads for
//! `vault:MOUNT/PATH#FIELD` secrets, token or AppRole login, and transit decryption of the
//! per-request `x-encrypted-key`. Nothing here imports the rest of the crate: the config layer
//! calls it while loading, the front door for decryption.
//!
//! Values are secrets: errors name the path, never a value; decrypted keys are held in
//! `Zeroizing` buffers that are wiped when dropped.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use sha2::{Digest, Sha256};
use vaultrs::client::{Client, VaultClient, VaultClientSettingsBuilder};
use zeroize::Zeroizing;

/// How the gateway logs in.
#[derive(Clone)]
pub enum Login {
    Token(Zeroizing<String>),
    AppRole {
        mount: String,
        role_id: String,
        secret_id: Zeroizing<String>,
    },
}

/// `vault:` in the config, resolved (its token or AppRole secret already read).
#[derive(Clone)]
pub struct Settings {
    pub address: String,
    pub login: Login,
    pub namespace: Option<String>,
    /// Re-read `vault:` secrets this often.
    pub refresh: Duration,
    /// Enables `x-encrypted-key`: the transit key ciphertexts are decrypted with.
    pub transit_key: Option<String>,
    pub transit_mount: String,
    /// Decrypted per-request keys are cached this long.
    pub cache_ttl: Duration,
    pub timeout: Duration,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("address", &self.address)
            .field(
                "login",
                &match self.login {
                    Login::Token(_) => "token",
                    Login::AppRole { .. } => "approle",
                },
            )
            .field("namespace", &self.namespace)
            .field("transit_key", &self.transit_key)
            .finish_non_exhaustive()
    }
}

/// `vault:MOUNT/PATH#FIELD`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ref {
    pub mount: String,
    pub path: String,
    pub field: String,
}

impl Ref {
    /// Parses the part after `vault:`.
    pub fn parse(spec: &str) -> Result<Ref, String> {
        let (location, field) = spec
            .trim()
            .split_once('#')
            .ok_or("a vault secret is written vault:MOUNT/PATH#FIELD")?;
        let (mount, path) = location
            .trim_matches('/')
            .split_once('/')
            .ok_or("a vault secret is written vault:MOUNT/PATH#FIELD")?;
        if mount.is_empty() || path.is_empty() || field.is_empty() {
            return Err("a vault secret is written vault:MOUNT/PATH#FIELD".into());
        }
        Ok(Ref {
            mount: mount.to_string(),
            path: path.to_string(),
            field: field.to_string(),
        })
    }
}

impl fmt::Display for Ref {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "vault:{}/{}#{}", self.mount, self.path, self.field)
    }
}

/// A logged-in client.
pub async fn connect(s: &Settings) -> Result<VaultClient, String> {
    let mut b = VaultClientSettingsBuilder::default();
    b.address(s.address.as_str())
        .timeout(Some(s.timeout))
        .verify(true)
        .token(match &s.login {
            Login::Token(t) => t.as_str().to_string(),
            Login::AppRole { .. } => String::new(),
        });
    if let Some(ns) = &s.namespace
        && !ns.is_empty()
    {
        b.set_namespace(ns.clone());
    }
    let settings = b.build().map_err(|e| format!("vault settings: {e}"))?;
    let mut client =
        VaultClient::new(settings).map_err(|e| format!("vault at {}: {e}", s.address))?;
    if let Login::AppRole {
        mount,
        role_id,
        secret_id,
    } = &s.login
    {
        let auth = vaultrs::auth::approle::login(&client, mount, role_id, secret_id)
            .await
            .map_err(|e| format!("vault approle login at {}: {}", s.address, shown(&e)))?;
        client.set_token(&auth.client_token);
    }
    Ok(client)
}

/// Reads every `refs` (KV v2). An error names the secret's path, never a value.
pub async fn read(s: &Settings, refs: &[Ref]) -> Result<HashMap<Ref, Zeroizing<String>>, String> {
    let client = connect(s).await?;
    let mut by_secret: HashMap<(String, String), HashMap<String, serde_json::Value>> =
        HashMap::new();
    let mut out = HashMap::new();
    for r in refs {
        let key = (r.mount.clone(), r.path.clone());
        if !by_secret.contains_key(&key) {
            let data: HashMap<String, serde_json::Value> =
                vaultrs::kv2::read(&client, &r.mount, &r.path)
                    .await
                    .map_err(|e| format!("vault:{}/{}: {}", r.mount, r.path, shown(&e)))?;
            by_secret.insert(key.clone(), data);
        }
        let value = by_secret
            .get(&key)
            .and_then(|d| d.get(&r.field))
            .and_then(|v| v.as_str())
            .filter(|v| !v.trim().is_empty())
            .ok_or_else(|| format!("{r}: no such field (or not a non-empty string)"))?;
        out.insert(r.clone(), Zeroizing::new(value.trim().to_string()));
    }
    Ok(out)
}

/// [`read`] from synchronous code (config loading), on a thread of its own with its own small
/// runtime, so it works whether or not the caller is inside a runtime.
pub fn read_blocking(
    s: &Settings,
    refs: &[Ref],
) -> Result<HashMap<Ref, Zeroizing<String>>, String> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| format!("vault: {e}"))?;
                rt.block_on(read(s, refs))
            })
            .join()
            .unwrap_or_else(|_| Err("vault: the reader panicked".into()))
    })
}

/// A digest of the values read, to tell whether a refresh changed anything.
pub fn digest(values: &HashMap<Ref, Zeroizing<String>>) -> String {
    let mut refs: Vec<&Ref> = values.keys().collect();
    refs.sort();
    let mut h = Sha256::new();
    for r in refs {
        h.update(r.to_string().as_bytes());
        h.update([0]);
        h.update(values[r].as_bytes());
        h.update([0]);
    }
    hex(&h.finalize())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A Vault error as operators may see it: its kind and the server's own messages, which name
/// paths and permissions, never secret values.
fn shown(e: &vaultrs::error::ClientError) -> String {
    match e {
        vaultrs::error::ClientError::APIError { code, errors } => {
            format!("HTTP {code}: {}", errors.join("; "))
        }
        other => {
            // The whole chain ("error sending request … connection refused"): the outermost
            // message alone says nothing.
            let mut s = other.to_string();
            let mut source = std::error::Error::source(other);
            while let Some(e) = source {
                s.push_str(": ");
                s.push_str(&e.to_string());
                source = e.source();
            }
            s.chars().take(300).collect()
        }
    }
}

/// Why an `x-encrypted-key` could not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecryptError {
    /// Not a transit ciphertext, or Vault refused to decrypt it (400 `invalid_encrypted_key`).
    Invalid,
    /// Vault could not be reached or logged into (503 `vault_unavailable`).
    Unavailable(String),
}

/// A Vault call shared by every request that needs its answer: the first starts it, the others
/// wait on the same future (one login, one decrypt per ciphertext), and no lock is held while it
/// runs.
type Flight<T> = Shared<BoxFuture<'static, T>>;

/// A login: the client it made, or why it failed.
type LoginFlight = Flight<Result<Arc<VaultClient>, String>>;

/// A decrypt: the plaintext key, or why there is none.
type DecryptFlight = Flight<Result<Zeroizing<String>, DecryptError>>;

/// Transit decryption of per-request keys, with a short cache keyed by the ciphertext's digest.
/// Decrypts of different ciphertexts run at once: the locks here guard maps and are never held
/// across a call to Vault.
pub struct Transit {
    settings: Arc<Settings>,
    /// The logged-in client, or the login under way.
    client: Mutex<Option<LoginFlight>>,
    /// Decrypts under way, by the ciphertext's digest.
    flights: Mutex<HashMap<[u8; 32], DecryptFlight>>,
    cache: Mutex<HashMap<[u8; 32], Cached>>,
}

/// A decrypted key and when it was decrypted.
type Cached = (Instant, Zeroizing<String>);

/// Entries kept at most in the decryption cache.
const CACHE_MAX: usize = 10_000;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Transit {
    pub fn new(settings: Settings) -> Transit {
        Transit {
            settings: Arc::new(settings),
            client: Mutex::new(None),
            flights: Mutex::new(HashMap::new()),
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The logged-in client: the one there is, or the login under way, or a new login.
    fn login(&self) -> LoginFlight {
        let mut slot = lock(&self.client);
        if let Some(f) = slot.as_ref() {
            return f.clone();
        }
        let settings = self.settings.clone();
        let f = async move { connect(&settings).await.map(Arc::new) }
            .boxed()
            .shared();
        *slot = Some(f.clone());
        f
    }

    /// Forgets `failed` (a login that failed, or a client Vault stopped taking): the next call
    /// logs in again. A newer login another request started meanwhile is kept.
    fn forget(&self, failed: &LoginFlight) {
        let mut slot = lock(&self.client);
        if slot.as_ref().is_some_and(|f| f.ptr_eq(failed)) {
            *slot = None;
        }
    }

    /// The plaintext key of `ciphertext` (`vault:v1:…`).
    pub async fn decrypt(
        self: &Arc<Self>,
        ciphertext: &str,
    ) -> Result<Zeroizing<String>, DecryptError> {
        let ciphertext = ciphertext.trim();
        if !ciphertext.starts_with("vault:v") || ciphertext.len() > 16 * 1024 {
            return Err(DecryptError::Invalid);
        }
        if self.settings.transit_key.is_none() {
            return Err(DecryptError::Invalid);
        }
        let id: [u8; 32] = Sha256::digest(ciphertext.as_bytes()).into();
        let now = Instant::now();
        {
            let mut cache = lock(&self.cache);
            match cache.get(&id) {
                Some((at, v)) if now.duration_since(*at) < self.settings.cache_ttl => {
                    return Ok(v.clone());
                }
                Some(_) => {
                    cache.remove(&id);
                }
                None => {}
            }
        }
        let flight = {
            let mut flights = lock(&self.flights);
            match flights.get(&id) {
                Some(f) => f.clone(),
                None => {
                    let me = self.clone();
                    let text = ciphertext.to_string();
                    let f = async move { me.decrypt_now(id, &text).await }
                        .boxed()
                        .shared();
                    flights.insert(id, f.clone());
                    f
                }
            }
        };
        flight.await
    }

    /// One decrypt at Vault, its answer cached; the flight is let go when it ends.
    async fn decrypt_now(
        &self,
        id: [u8; 32],
        ciphertext: &str,
    ) -> Result<Zeroizing<String>, DecryptError> {
        let result = self.call_decrypt(ciphertext).await;
        if let Ok(value) = &result {
            let now = Instant::now();
            let mut cache = lock(&self.cache);
            if cache.len() >= CACHE_MAX {
                let ttl = self.settings.cache_ttl;
                cache.retain(|_, (at, _)| now.duration_since(*at) < ttl);
                if cache.len() >= CACHE_MAX {
                    cache.clear();
                }
            }
            cache.insert(id, (now, value.clone()));
        }
        lock(&self.flights).remove(&id);
        result
    }

    async fn call_decrypt(&self, ciphertext: &str) -> Result<Zeroizing<String>, DecryptError> {
        let Some(key) = self.settings.transit_key.as_deref() else {
            return Err(DecryptError::Invalid);
        };
        let login = self.login();
        let client = match login.clone().await {
            Ok(c) => c,
            Err(e) => {
                self.forget(&login);
                return Err(DecryptError::Unavailable(e));
            }
        };
        let result = vaultrs::transit::data::decrypt(
            client.as_ref(),
            &self.settings.transit_mount,
            key,
            ciphertext,
            None,
        )
        .await;
        let plaintext = match result {
            Ok(r) => Zeroizing::new(r.plaintext),
            Err(vaultrs::error::ClientError::APIError { code, .. })
                if (400..500).contains(&code) && code != 403 =>
            {
                return Err(DecryptError::Invalid);
            }
            Err(e) => {
                // A lapsed token or a restarted server: log in again next time.
                self.forget(&login);
                return Err(DecryptError::Unavailable(shown(&e)));
            }
        };
        let bytes = Zeroizing::new(
            base64::engine::general_purpose::STANDARD
                .decode(plaintext.as_bytes())
                .map_err(|_| DecryptError::Invalid)?,
        );
        let text = std::str::from_utf8(&bytes).map_err(|_| DecryptError::Invalid)?;
        let value = Zeroizing::new(text.trim().to_string());
        if value.is_empty() {
            return Err(DecryptError::Invalid);
        }
        Ok(value)
    }
}

/// What identifies a transit decrypter's settings, credentials included (as a digest): a reload
/// that changes the address, key, namespace, token or AppRole gets a new one, which logs in
/// with the new credentials.
pub fn transit_id(s: &Settings) -> String {
    let mut h = Sha256::new();
    for part in [
        s.address.as_str(),
        s.transit_mount.as_str(),
        s.transit_key.as_deref().unwrap_or(""),
        s.namespace.as_deref().unwrap_or(""),
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    match &s.login {
        Login::Token(t) => {
            h.update(b"token\0");
            h.update(t.as_bytes());
        }
        Login::AppRole {
            mount,
            role_id,
            secret_id,
        } => {
            h.update(b"approle\0");
            for part in [mount.as_str(), role_id.as_str(), secret_id.as_str()] {
                h.update(part.as_bytes());
                h.update([0]);
            }
        }
    }
    h.update(s.timeout.as_nanos().to_le_bytes());
    h.update(s.cache_ttl.as_nanos().to_le_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refs_parse_and_print() {
        let r = Ref::parse("secret/openai#api_key").unwrap();
        assert_eq!(
            (r.mount.as_str(), r.path.as_str(), r.field.as_str()),
            ("secret", "openai", "api_key")
        );
        assert_eq!(r.to_string(), "vault:secret/openai#api_key");
        let deep = Ref::parse("kv/team/a/keys#k").unwrap();
        assert_eq!(
            (deep.mount.as_str(), deep.path.as_str()),
            ("kv", "team/a/keys")
        );
        for bad in [
            "secret/openai",
            "secret#f",
            "/x#f",
            "secret/#f",
            "secret/x#",
            "",
        ] {
            assert!(Ref::parse(bad).is_err(), "{bad}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_ref_text_parses_or_errs(s in "\\PC{0,80}") {
            let _ = Ref::parse(&s);
        }
    }
}
