//! The documentation holds together: every relative link in the README, `docs/`,
//! `dashboards/` and `deploy/` names a file that exists and, with a `#fragment`, a heading or
//! `<a id>` in it (GitHub's anchors); every alert's runbook link lands; the README's Azure
//! configuration is one hubguard accepts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown pages a reader follows links through.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![
        root().join("README.md"),
        root().join("BENCHMARKS.md"),
        root().join("dashboards/README.md"),
        root().join("deploy/README.md"),
    ];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    out.extend(docs);
    out
}

/// GitHub's anchor for a heading: lower case, spaces to `-`, punctuation other than `-` and
/// `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors a page offers: its headings (outside code blocks) and its `<a id="…">`s.
fn anchors(page: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(page).unwrap();
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            out.insert(slug(&line[hashes..].replace('`', "")));
        }
    }
    for (i, _) in text.match_indices("<a id=\"") {
        let rest = &text[i + 7..];
        out.insert(rest[..rest.find('"').unwrap()].to_string());
    }
    out
}

/// The `](target)` links of a page, outside code blocks.
fn links(page: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(page).unwrap();
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        for (i, _) in line.match_indices("](") {
            let rest = &line[i + 2..];
            if let Some(end) = rest.find(')') {
                out.push(rest[..end].to_string());
            }
        }
    }
    out
}

/// Checks one link of `page`; `Err` says what is wrong.
fn check(page: &Path, target: &str) -> Result<(), String> {
    if target.starts_with("http://") || target.starts_with("https://") {
        return Ok(());
    }
    let (path, fragment) = target.split_once('#').unwrap_or((target, ""));
    let file = if path.is_empty() {
        page.to_path_buf()
    } else {
        page.parent().unwrap().join(path)
    };
    if !file.exists() {
        return Err(format!("{target}: {} does not exist", file.display()));
    }
    if !fragment.is_empty() && file.extension().is_some_and(|x| x == "md") {
        let offered = anchors(&file);
        if !offered.contains(fragment) {
            return Err(format!(
                "{target}: no heading or <a id> `{fragment}` in {}",
                file.display()
            ));
        }
    }
    Ok(())
}

#[test]
fn every_link_in_the_docs_lands() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        for target in links(&page) {
            checked += 1;
            if let Err(e) = check(&page, &target) {
                broken.push(format!("{}: {e}", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(
        checked >= 20,
        "only {checked} links found: is the parser reading the pages?"
    );
}

#[test]
fn the_link_check_finds_a_broken_link_and_a_missing_anchor() {
    let readme = root().join("README.md");
    assert!(check(&readme, "docs/guarantee.md").is_ok());
    assert!(check(&readme, "docs/no-such-page.md").is_err());
    assert!(check(&readme, "docs/guarantee.md#no-such-heading").is_err());
    assert!(check(&readme, "#two-commands").is_ok());
    assert_eq!(
        slug("Service Bus: credentials, roles and the start-up proof"),
        "service-bus-credentials-roles-and-the-start-up-proof"
    );
}

#[test]
fn every_runbook_link_of_the_alerts_lands() {
    let rules = std::fs::read_to_string(root().join("dashboards/prometheus/alerts.yaml")).unwrap();
    let mut n = 0;
    for line in rules.lines() {
        if let Some(rest) = line.trim().strip_prefix("runbook_url:") {
            let target = rest.trim().trim_matches('"');
            check(&root().join("alerts.yaml"), target).unwrap();
            n += 1;
        }
    }
    assert!(n >= 16, "{n} runbook links");
}

#[test]
fn the_readmes_azure_configuration_is_accepted() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let block = readme
        .split("```toml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a toml block in the README");
    let config = hubguard::config::Config::parse(block, Vec::<(String, String)>::new())
        .unwrap_or_else(|e| panic!("the README's configuration is refused: {e}\n{block}"));
    assert_eq!(config.eventhubs.hub, "orders");
}

#[test]
fn the_readme_stays_what_a_new_user_needs() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    for needed in [
        "cargo run --release -- demo",
        "cargo test",
        "## Running it on Azure",
        "## Where to go next",
    ] {
        assert!(readme.contains(needed), "the README lost `{needed}`");
    }
    let lines = readme.lines().count();
    assert!(
        lines <= 250,
        "the README is {lines} lines: reference belongs in docs/"
    );
}
