//! The module map holds: the product's top-level modules form no import cycle, and none of
//! them refers to the test bed (the emulators, the demo, the bench, the command line), which
//! a program embedding the library does not compile. Read from the sources, so a new `use`
//! that breaks the map fails here, naming the files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const PRODUCT: &[&str] = &[
    "azure",
    "breaker",
    "clock",
    "config",
    "console",
    "event",
    "guard",
    "handler",
    "ledger",
    "opsevents",
    "pipeline",
    "policy",
    "redact",
    "ratelimit",
    "status",
    "telemetry",
    "wiring",
];
const TEST_BED: &[&str] = &["bench", "cli", "demo", "emulator"];

fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        for entry in std::fs::read_dir(path).unwrap() {
            rust_files(&entry.unwrap().path(), out);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_path_buf());
    }
}

/// The top-level modules a piece of code names through `crate::…` (code only, not
/// comments), with `use crate::{a::…, b}` groups opened.
fn referenced(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let mut depth = 0;
                let mut item_start = true;
                for (j, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => item_start = true,
                        c if item_start && (c.is_alphabetic() || c == '_') => {
                            let name: String = group[j..]
                                .chars()
                                .take_while(|c| c.is_alphanumeric() || *c == '_')
                                .collect();
                            found.insert(name);
                            item_start = false;
                        }
                        _ => {}
                    }
                }
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                found.insert(name);
            }
        }
    }
    found
}

fn module_graph() -> BTreeMap<&'static str, BTreeMap<String, Vec<String>>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = BTreeMap::new();
    for module in PRODUCT.iter().chain(TEST_BED) {
        let mut files = Vec::new();
        let dir = src.join(module);
        if dir.is_dir() {
            rust_files(&dir, &mut files);
        } else {
            files.push(src.join(format!("{module}.rs")));
        }
        let mut edges: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for file in files {
            let code = std::fs::read_to_string(&file).unwrap();
            let shown = file.strip_prefix(&src).unwrap().display().to_string();
            for target in referenced(&code) {
                if target != *module {
                    edges.entry(target).or_default().push(shown.clone());
                }
            }
        }
        graph.insert(*module, edges);
    }
    graph
}

#[test]
fn the_reference_reader_sees_paths_groups_and_skips_comments() {
    let code = "use crate::{ledger::Ledger, pipeline};\n// crate::demo\nlet x = crate::clock::ms(t);\nuse crate::{azure::{A, B}, event::E};";
    let found: Vec<String> = referenced(code).into_iter().collect();
    assert_eq!(found, ["azure", "clock", "event", "ledger", "pipeline"]);
}

#[test]
fn no_product_module_refers_to_the_test_bed() {
    let graph = module_graph();
    let mut wrong = Vec::new();
    for module in PRODUCT {
        for bed in TEST_BED {
            if let Some(files) = graph[module].get(*bed) {
                wrong.push(format!("{module} → {bed} in {files:?}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn the_product_modules_form_no_import_cycle() {
    let graph = module_graph();
    // Depth-first search for a back edge among product modules.
    fn visit(
        m: &str,
        graph: &BTreeMap<&'static str, BTreeMap<String, Vec<String>>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut cycle = path[i..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in graph[m].keys().filter(|n| PRODUCT.contains(&n.as_str())) {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for module in PRODUCT {
        if let Some(cycle) = visit(module, &graph, &mut Vec::new(), &mut done) {
            let files: Vec<String> = cycle
                .windows(2)
                .map(|w| format!("{} → {}: {:?}", w[0], w[1], graph[w[0].as_str()][&w[1]]))
                .collect();
            panic!("import cycle {}\n{files:#?}", cycle.join(" → "));
        }
    }
}
