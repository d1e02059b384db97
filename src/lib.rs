//! AutoHedge: one OpenAI-compatible endpoint over a fleet of LLM backends. See ARCHITECTURE.md
//! for how a request flows through these modules.

/// `println!` that never panics: a closed stdout (`autohedge check-config | head -1`, a parent
/// that went away) must not take the command — or a serving gateway — down.
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

pub mod alloc;
pub mod cli;
pub mod clients;
pub mod cluster;
pub mod config;
pub mod demo;
pub mod discovery;
pub mod error;
pub mod executor;
pub mod front;
pub mod op;
pub mod ops;
pub mod routing;
pub mod state;
pub mod store;
pub mod tokens;
pub mod upstream;
pub mod wire;

/// The layering ARCHITECTURE.md promises, checked on the source: the policy and vocabulary
/// modules below the request path import nothing of it, so a change to the request path cannot
/// reach into config, counting or health policy (and no import circle can form again).
#[cfg(test)]
mod layering {
    /// (module, its files, what it may import from the crate). A module in a folder is named
    /// with it (`routing::health`), as its imports are.
    const LAYERS: &[(&str, &[&str], &[&str])] = &[
        ("op", &[include_str!("op.rs")], &[]),
        ("alloc", &[include_str!("alloc.rs")], &[]),
        (
            "routing::outcome",
            &[include_str!("routing/outcome.rs")],
            &[],
        ),
        ("routing::blame", &[include_str!("routing/blame.rs")], &[]),
        (
            "routing::stats",
            &[include_str!("routing/stats.rs")],
            &["routing::blame"],
        ),
        (
            "routing::health",
            &[include_str!("routing/health.rs")],
            &["routing::blame"],
        ),
        ("routing::hedge", &[include_str!("routing/hedge.rs")], &[]),
        (
            "upstream::h1pool",
            &[include_str!("upstream/h1pool.rs")],
            &[],
        ),
        (
            "front::send_deadline",
            &[include_str!("front/send_deadline.rs")],
            &[],
        ),
        ("front::selfwake", &[include_str!("front/selfwake.rs")], &[]),
        (
            "front::stop",
            &[include_str!("front/stop.rs")],
            &["front::selfwake"],
        ),
        ("front::timer", &[include_str!("front/timer.rs")], &[]),
        (
            "routing::ratelimit",
            &[include_str!("routing/ratelimit.rs")],
            &[],
        ),
        ("config::vault", &[include_str!("config/vault.rs")], &[]),
        (
            "tokens",
            &[
                include_str!("tokens/mod.rs"),
                include_str!("tokens/truncate.rs"),
                include_str!("tokens/pool.rs"),
            ],
            &["op", "tokens", "alloc"],
        ),
        // Who may call and what a key may spend: below the front door and the executor that
        // read it, beside routing; it asks the shared store (`cluster`) and reads the config.
        (
            "clients",
            &[include_str!("clients/mod.rs")],
            &["cluster", "config", "error"],
        ),
        (
            "config",
            &[
                include_str!("config/mod.rs"),
                include_str!("config/raw.rs"),
                include_str!("config/types.rs"),
                include_str!("config/resolve.rs"),
                include_str!("config/describe.rs"),
                include_str!("config/duration.rs"),
            ],
            &[
                "op",
                "tokens",
                "routing::health",
                "routing::hedge",
                "config::vault",
                "upstream::h1pool",
                "config",
            ],
        ),
    ];

    /// The module a `crate::…` path names: its first segment, with the second for the folders
    /// that group modules (`crate::routing::health::X` → `routing::health`).
    fn named(path: &str) -> String {
        let seg = |t: &str| -> String {
            t.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        };
        let first = seg(path);
        if ["routing", "front", "ops", "discovery", "upstream"].contains(&first.as_str())
            && let Some(rest) = path[first.len()..].strip_prefix("::")
        {
            return format!("{first}::{}", seg(rest));
        }
        first
    }

    /// Every module (a file under `src/`, or a folder's file) and the modules it imports, from
    /// `crate::…` and `super::…` paths outside its tests: a folder's files are modules of their
    /// own (a path into a folder names the file it reaches), and a file's imports of its own
    /// folder's `mod.rs` (`super::after`) are not edges.
    fn import_graph() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
        use std::collections::{BTreeMap, BTreeSet};
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files: BTreeMap<String, String> = BTreeMap::new();
        let mut folders: BTreeSet<String> = BTreeSet::new();
        for entry in std::fs::read_dir(&src).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                folders.insert(name.clone());
                for f in std::fs::read_dir(&path).unwrap() {
                    let f = f.unwrap().path();
                    if f.is_dir() {
                        // A folder within a folder (`routing/registry/`): one module, its files
                        // read as one.
                        let stem = f.file_name().unwrap().to_string_lossy().into_owned();
                        let mut text = String::new();
                        for g in std::fs::read_dir(&f).unwrap() {
                            let g = g.unwrap().path();
                            if g.extension().is_some_and(|e| e == "rs") {
                                // Each file's code before its tests, as below.
                                let g = std::fs::read_to_string(&g).unwrap();
                                text.push_str(g.split("\n#[cfg(test)]").next().unwrap_or(""));
                                text.push('\n');
                            }
                        }
                        files.insert(format!("{name}::{stem}"), text);
                    } else if f.extension().is_some_and(|e| e == "rs") {
                        let stem = f.file_stem().unwrap().to_string_lossy().into_owned();
                        let node = if stem == "mod" {
                            name.clone()
                        } else {
                            format!("{name}::{stem}")
                        };
                        files.insert(node, std::fs::read_to_string(&f).unwrap());
                    }
                }
            } else if path.extension().is_some_and(|e| e == "rs") && name != "lib" && name != "main"
            {
                files.insert(name, std::fs::read_to_string(&path).unwrap());
            }
        }
        let ident = |t: &str| -> String {
            t.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        };
        let mut graph = BTreeMap::new();
        for (node, text) in &files {
            // Tests may reach anywhere: only the code before the first `#[cfg(test)]` counts,
            // and not its comments (a doc link is not an import).
            let code: String = text
                .split("\n#[cfg(test)]")
                .next()
                .unwrap_or(text)
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let code = code.as_str();
            let folder = node.split("::").next().unwrap().to_string();
            let inside = node.contains("::");
            let mut to = BTreeSet::new();
            for (at, _) in code.match_indices("crate::") {
                let first = ident(&code[at + 7..]);
                let rest = &code[at + 7 + first.len()..];
                // The most specific module the path names: a folder's file when it has one.
                let target = match rest.strip_prefix("::").map(ident) {
                    Some(second) if files.contains_key(&format!("{first}::{second}")) => {
                        format!("{first}::{second}")
                    }
                    _ => first,
                };
                to.insert(target);
            }
            if inside {
                for (at, _) in code.match_indices("super::") {
                    let sibling = format!("{folder}::{}", ident(&code[at + 7..]));
                    if files.contains_key(&sibling) {
                        to.insert(sibling);
                    }
                }
            }
            to.retain(|t| {
                files.contains_key(t)
                    && t != node
                    // A folder and its own files: its inside, not an import.
                    && !(t == &folder && inside)
                    && !(node == &folder && t.starts_with(&format!("{folder}::")))
            });
            graph.insert(node.clone(), to);
        }
        assert!(
            folders.contains("executor") && graph.len() > 30,
            "the reader is broken"
        );
        graph
    }

    /// No import circle between modules: each one can be read, tested and changed knowing only
    /// what is below it. Fails naming the circle.
    #[test]
    fn no_module_imports_one_that_imports_it_back() {
        let graph = import_graph();
        // For each module, the modules it reaches; a circle is a module that reaches itself (the
        // graph is a few dozen nodes: no cleverer algorithm is needed).
        let reach = |from: &str| {
            let mut seen = std::collections::BTreeSet::new();
            let mut stack = vec![from.to_string()];
            while let Some(n) = stack.pop() {
                for t in graph.get(&n).into_iter().flatten() {
                    if seen.insert(t.clone()) {
                        stack.push(t.clone());
                    }
                }
            }
            seen
        };
        for a in graph.keys() {
            let from_a = reach(a);
            if from_a.contains(a) {
                let circle: Vec<&String> = from_a.iter().filter(|b| reach(b).contains(a)).collect();
                panic!("an import circle through `{a}`: {circle:?}");
            }
        }
    }

    #[test]
    fn lower_layers_import_nothing_of_the_request_path() {
        for (module, files, allowed) in LAYERS {
            for text in *files {
                for (at, _) in text.match_indices("crate::") {
                    let name = named(&text[at + 7..]);
                    assert!(
                        allowed.contains(&name.as_str()),
                        "`{module}` imports `crate::{name}`: it may import only {allowed:?}"
                    );
                }
            }
        }
    }
}
