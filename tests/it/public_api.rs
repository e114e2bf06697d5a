//! The library's public surface without the test bed is a decision, not an accident: the
//! items an embedder sees (`hubguard = { …, default-features = false }`) are listed in
//! `tests/it/public_api.txt`, and this test fails on any item, method, field or variant
//! that appears or disappears without the list changing with it.
//!
//! It documents the library as an embedder builds it (`cargo doc --no-deps --lib
//! --no-default-features`, into a target directory of its own, `target/public-api`: a nested
//! cargo on the test's own target directory would wait forever on cargo's lock) and reads
//! rustdoc's HTML: `all.html` lists every public item; each struct's, enum's and trait's page
//! names its fields, variants and inherent or trait methods (`id="method.…"` and the like).
//! The first run checks the dependencies without the test bed's features (minutes, once);
//! later runs document the crate alone (seconds).
//!
//! To change the surface deliberately, run the test with `HUBGUARD_BLESS_PUBLIC_API=1`: it
//! rewrites the list, and the diff goes to review with the change.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const LIST: &str = "tests/it/public_api.txt";
const BLESS: &str = "HUBGUARD_BLESS_PUBLIC_API";

/// The documentation of the library without the test bed: the directory of `hubguard`'s
/// pages (built once per test run).
fn document() -> PathBuf {
    static DOC: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DOC.get_or_init(build_documentation).clone()
}

fn build_documentation() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let target = if target.is_absolute() {
        target
    } else {
        root.join(target)
    };
    let target = target.join("public-api");
    let out = Command::new(env!("CARGO"))
        .args(["doc", "--no-deps", "--lib", "--no-default-features"])
        .current_dir(root)
        .env("CARGO_TARGET_DIR", &target)
        // Whatever flags the surrounding build has, the pages are only read here.
        .env_remove("RUSTDOCFLAGS")
        .env_remove("CARGO_ENCODED_RUSTDOCFLAGS")
        .output()
        .expect("cannot run cargo doc");
    assert!(
        out.status.success(),
        "cargo doc --no-deps --lib --no-default-features failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    target.join("doc").join("hubguard")
}

/// The values of every `attr="…"` in `html`, in order.
fn attributes<'h>(html: &'h str, attr: &str) -> Vec<&'h str> {
    let open = format!("{attr}=\"");
    let mut found = Vec::new();
    let mut rest = html;
    while let Some(i) = rest.find(&open) {
        rest = &rest[i + open.len()..];
        let Some(end) = rest.find('"') else { break };
        found.push(&rest[..end]);
        rest = &rest[end..];
    }
    found
}

/// The top-level items `all.html` lists, as (kind, path, page), e.g. `("struct",
/// "Pipeline", "struct.Pipeline.html")`.
fn items(all_html: &str) -> Vec<(String, String, String)> {
    let mut items = Vec::new();
    for href in attributes(all_html, "href") {
        if href.starts_with("../") || href.starts_with('#') || href.contains("://") {
            continue;
        }
        let Some(page) = href.strip_suffix(".html") else {
            continue;
        };
        let mut segments: Vec<&str> = page.split('/').collect();
        let last = segments.pop().unwrap_or_default();
        let (kind, name) = match last.split_once('.') {
            Some((kind, name)) => (kind.to_string(), name.to_string()),
            None if last == "index" => match segments.pop() {
                Some(module) => ("mod".to_string(), module.to_string()),
                None => continue,
            },
            None => continue,
        };
        segments.push(&name);
        items.push((kind, segments.join("::"), href.to_string()));
    }
    items
}

/// The members an item's page shows as public: fields, variants, inherent methods and
/// associated constants (not trait implementations), a trait's methods and associated
/// types; as (kind, name).
fn members(kind: &str, page: &str) -> BTreeSet<(String, String)> {
    let (own, inherent) = match kind {
        "struct" | "enum" | "union" => {
            // Fields and variants come before the first list of implementations.
            let own_end = [
                "id=\"implementations\"",
                "id=\"trait-implementations\"",
                "id=\"synthetic-implementations\"",
                "id=\"blanket-implementations\"",
            ]
            .iter()
            .filter_map(|h| page.find(h))
            .min()
            .unwrap_or(page.len());
            let inherent = match page.find("id=\"implementations-list\"") {
                Some(start) => {
                    let rest = &page[start..];
                    let end = [
                        "id=\"trait-implementations\"",
                        "id=\"synthetic-implementations\"",
                        "id=\"blanket-implementations\"",
                    ]
                    .iter()
                    .filter_map(|h| rest.find(h))
                    .min()
                    .unwrap_or(rest.len());
                    &rest[..end]
                }
                None => "",
            };
            (&page[..own_end], inherent)
        }
        "trait" => (
            &page[..page.find("id=\"implementors\"").unwrap_or(page.len())],
            "",
        ),
        _ => ("", ""),
    };
    let mut found = BTreeSet::new();
    for (part, kinds) in [
        (
            own,
            &[
                ("structfield", "field"),
                ("variant", "variant"),
                ("tymethod", "method"),
                ("method", "method"),
                ("associatedtype", "type"),
                ("associatedconstant", "const"),
            ][..],
        ),
        (
            inherent,
            &[("method", "method"), ("associatedconstant", "const")][..],
        ),
    ] {
        for id in attributes(part, "id") {
            let Some((prefix, name)) = id.split_once('.') else {
                continue;
            };
            // A variant's fields (`variant.V.field.f`) belong to the variant.
            let name = name.split('.').next().unwrap_or(name);
            if let Some((_, shown)) = kinds.iter().find(|(p, _)| *p == prefix) {
                found.insert((shown.to_string(), name.to_string()));
            }
        }
    }
    found
}

/// A page's text: tags dropped, entities read.
fn text(html: &str) -> String {
    let mut out = String::with_capacity(html.len());
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&nbsp;", " ")
        .replace("&amp;", "&")
}

/// The `Result<T, String>`s and `type Err = String`s in a page's text.
fn string_errors(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (i, _) in text.match_indices("Result<") {
        let args = &text[i + "Result<".len()..];
        let (mut depth, mut split, mut end) = (0usize, None, None);
        for (j, c) in args.char_indices() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' | ')' | ']' if depth == 0 => {
                    end = Some(j);
                    break;
                }
                '>' | ')' | ']' => depth -= 1,
                ',' if depth == 0 => split = Some(j),
                _ => {}
            }
        }
        if let (Some(split), Some(end)) = (split, end) {
            if args[split + 1..end].trim() == "String" {
                found.push(format!("Result<{}>", &args[..end]));
            }
        }
    }
    for assoc in ["type Err = String", "type Error = String"] {
        if text.contains(assoc) {
            found.push(assoc.to_string());
        }
    }
    found
}

/// The surface: one `kind path` line per item and member, an item's members after it.
fn surface(doc: &Path) -> Vec<String> {
    let all = std::fs::read_to_string(doc.join("all.html")).expect("all.html");
    let mut lines = Vec::new();
    for (kind, path, href) in items(&all) {
        lines.push((path.clone(), format!("{kind} {path}")));
        if let Ok(page) = std::fs::read_to_string(doc.join(&href)) {
            for (member_kind, name) in members(&kind, &page) {
                let member = format!("{path}::{name}");
                lines.push((member.clone(), format!("{member_kind} {member}")));
            }
        }
    }
    lines.sort();
    lines.dedup();
    lines.into_iter().map(|(_, line)| line).collect()
}

#[test]
fn the_reader_finds_items_and_members() {
    let all = r##"<a href="../static.files/x.css"></a><a href="#structs">Structs</a>
        <li><a href="struct.Pipeline.html">Pipeline</a></li>
        <li><a href="memory/struct.Twin.html">memory::Twin</a></li>
        <li><a href="fn.status_router.html">status_router</a></li>"##;
    let found: Vec<(String, String)> = items(all).into_iter().map(|(k, p, _)| (k, p)).collect();
    assert_eq!(
        found,
        [
            ("struct".to_string(), "Pipeline".to_string()),
            ("struct".to_string(), "memory::Twin".to_string()),
            ("fn".to_string(), "status_router".to_string()),
        ]
    );
    let page = r#"<span id="structfield.owner_id"></span><span id="variant.Open.field.until"></span>
        <h2 id="implementations">Implementations</h2><div id="implementations-list">
        <section id="method.run"></section><section id="associatedconstant.LIMIT"></section></div>
        <h2 id="trait-implementations">Trait Implementations</h2>
        <div id="trait-implementations-list"><section id="method.fmt"></section></div>"#;
    let found: Vec<String> = members("struct", page)
        .into_iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    assert_eq!(
        found,
        [
            "const LIMIT",
            "field owner_id",
            "method run",
            "variant Open"
        ]
    );
}

#[test]
fn the_string_error_reader_finds_them_only() {
    let page = "<pre>pub fn parse(s: &amp;str) -&gt; <a>Result</a>&lt;<a>Vec</a>&lt;u8&gt;, <a>String</a>&gt;</pre>\
                <pre>pub fn ok() -&gt; Result&lt;(String, u8), Error&gt;</pre>\
                <pre>pub fn warnings() -&gt; Result&lt;Vec&lt;String&gt;, WiringError&gt;</pre>";
    assert_eq!(string_errors(&text(page)), ["Result<Vec<u8>, String>"]);
    assert_eq!(
        string_errors("impl FromStr for X { type Err = String; }"),
        ["type Err = String"]
    );
}

/// Errors are typed wherever a caller decides on them: no public signature of the library
/// without the test bed returns a `String` error.
#[test]
fn no_public_signature_has_a_string_error() {
    let doc = document();
    let all = std::fs::read_to_string(doc.join("all.html")).expect("all.html");
    let mut found = Vec::new();
    for (_, path, href) in items(&all) {
        let page = std::fs::read_to_string(doc.join(&href)).unwrap_or_default();
        for e in string_errors(&text(&page)) {
            found.push(format!("{path}: {e}"));
        }
    }
    assert!(
        found.is_empty(),
        "String errors in the public API (give them an error type naming the problem):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_public_api_without_the_test_bed_is_the_listed_one() {
    let doc = document();
    let actual = surface(&doc);
    assert!(
        actual.iter().any(|l| l == "trait Handler"),
        "the documentation read has no Handler: the reader no longer understands rustdoc's pages ({})",
        doc.display()
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(LIST);
    if std::env::var_os(BLESS).is_some() {
        let mut text = String::from(
            "# The library's public API without the test bed (tests/it/public_api.rs): one\n\
             # `kind path` per line. Regenerate with HUBGUARD_BLESS_PUBLIC_API=1 and review the diff.\n",
        );
        for line in &actual {
            text.push_str(line);
            text.push('\n');
        }
        std::fs::write(&path, text).expect("write the public API list");
        return;
    }
    let listed = std::fs::read_to_string(&path).unwrap_or_default();
    let expected: BTreeSet<&str> = listed
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let actual_set: BTreeSet<&str> = actual.iter().map(String::as_str).collect();
    let unexpected: Vec<&str> = actual_set.difference(&expected).copied().collect();
    let missing: Vec<&str> = expected.difference(&actual_set).copied().collect();
    assert!(
        unexpected.is_empty() && missing.is_empty(),
        "the public API without the test bed differs from {LIST}\n\
         unexpected (public now, not listed):\n  {}\n\
         missing (listed, not public now):\n  {}\n\
         If the change is deliberate, run `{BLESS}=1 cargo test --test it public_api` and \
         commit the list with it; otherwise make the item private, gate it behind the \
         `testbed` feature, or re-export what the API needs in src/lib.rs.",
        unexpected.join("\n  "),
        missing.join("\n  ")
    );
}
