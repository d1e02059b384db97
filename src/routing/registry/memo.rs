//! The per-thread memo behind `Registry::get`: the endpoint found last, given again without the
//! map's lock while its name and the map's generation still match.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{EndpointRuntime, Registry};

/// Longest endpoint name [`Registry::get`] remembers (longer ones are looked up every time).
const MEMO_NAME: usize = 48;

/// The endpoint [`Registry::get`] found last on this thread.
struct Got {
    generation: u64,
    len: usize,
    bytes: [u8; MEMO_NAME],
    runtime: Arc<Mutex<EndpointRuntime>>,
}

impl Got {
    fn name(&self) -> Option<&[u8]> {
        self.bytes.get(..self.len)
    }
}

thread_local! {
    static LAST_GOT: std::cell::RefCell<Option<Got>> = const { std::cell::RefCell::new(None) };
}

/// A generation no registry has had: registries start with one and every sync takes a new one.
pub(super) fn next_generation() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Registry {
    /// An endpoint's runtime state. A request asks for the same endpoint's several times (its
    /// view, key pick, rate-limit reading, outcome, tokens): the last one found is remembered
    /// per thread, with the name (as bytes, when short) and the generation of the map it came
    /// from, and given again without the lock and the hash while both still match.
    pub fn get(&self, name: &str) -> Option<Arc<Mutex<EndpointRuntime>>> {
        let generation = self.generation.load(Ordering::Acquire);
        let hit = LAST_GOT.with_borrow(|last| {
            last.as_ref()
                .filter(|l| l.generation == generation && l.name() == Some(name.as_bytes()))
                .map(|l| l.runtime.clone())
        });
        if hit.is_some() {
            return hit;
        }
        let runtime = self.map.read().ok()?.get(name).cloned()?;
        if name.len() <= MEMO_NAME {
            let mut bytes = [0; MEMO_NAME];
            bytes[..name.len()].copy_from_slice(name.as_bytes());
            LAST_GOT.set(Some(Got {
                generation,
                len: name.len(),
                bytes,
                runtime: runtime.clone(),
            }));
        }
        Some(runtime)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::store::StoreHandle;

    #[test]
    fn the_remembered_runtime_is_given_only_for_its_name_registry_and_generation() {
        let load = |names: &[&str]| {
            let mut yaml = String::from("models:\n");
            for n in names {
                yaml.push_str(&format!(
                    "  {n}: {{ type: openai, base_url: \"http://127.0.0.1:9/v1\" }}\n"
                ));
            }
            Config::load(&yaml).unwrap()
        };
        let long = "l".repeat(MEMO_NAME + 5);
        let cfg = load(&["a", "ab", &long]);
        let (one, two) = (
            Registry::new(StoreHandle::off("test".into())),
            Registry::new(StoreHandle::off("test".into())),
        );
        one.sync(&cfg, &[]);
        two.sync(&cfg, &[]);
        let a = one.get("a").expect("a is there");
        // Asked again (remembered): the same state; a name that shares its first bytes, another
        // registry's endpoint of the same name, a long name: each its own.
        assert!(Arc::ptr_eq(&one.get("a").unwrap(), &a));
        let ab = one.get("ab").unwrap();
        assert!(!Arc::ptr_eq(&ab, &a));
        assert!(Arc::ptr_eq(&one.get("a").unwrap(), &a));
        assert!(
            !Arc::ptr_eq(&two.get("a").unwrap(), &a),
            "two registries, two states"
        );
        assert!(Arc::ptr_eq(&one.get("a").unwrap(), &a));
        let l = one.get(&long).unwrap();
        assert!(Arc::ptr_eq(&one.get(&long).unwrap(), &l));
        assert!(one.get("b").is_none());
        // A reload without `a`: its state is gone, remembered or not.
        assert!(Arc::ptr_eq(&one.get("a").unwrap(), &a));
        one.sync(&load(&["ab"]), &[]);
        assert!(one.get("a").is_none(), "removed by the reload");
        assert!(
            Arc::ptr_eq(&one.get("ab").unwrap(), &ab),
            "kept by the reload"
        );
        // Put back: fresh state, not the state remembered from before.
        one.sync(&load(&["a", "ab"]), &[]);
        let again = one.get("a").unwrap();
        assert!(!Arc::ptr_eq(&again, &a));
        assert!(Arc::ptr_eq(&one.get("a").unwrap(), &again));
    }
}
