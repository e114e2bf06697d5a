//! The dashboards and the documented queries refer only to names the code emits.

use std::collections::BTreeSet;
use std::path::Path;

use hubguard::telemetry::names;

fn normalise(s: &str) -> String {
    s.replace('.', "_")
}

/// Whether `token` (a telemetry name, possibly in Prometheus' spelling) is one hubguard emits.
fn known(token: &str, emitted: &BTreeSet<String>) -> bool {
    let mut t = normalise(token);
    if emitted.contains(&t) {
        return true;
    }
    for suffix in ["_total", "_bucket", "_sum", "_count"] {
        if let Some(s) = t.strip_suffix(suffix) {
            t = s.to_string();
            break;
        }
    }
    emitted.contains(&t)
        || t.strip_suffix("_seconds")
            .is_some_and(|s| emitted.contains(s))
}

fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let rest: String = bytes[i..].iter().take(9).collect();
        let starts = rest.starts_with("hubguard.")
            || rest.starts_with("hubguard_")
            || rest.starts_with("messaging")
            || rest.starts_with("error.typ");
        let boundary = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == '_'
                || bytes[i - 1] == '/'
                || bytes[i - 1] == '-');
        if starts && boundary {
            let mut j = i;
            while j < bytes.len()
                && (bytes[j].is_ascii_alphanumeric() || bytes[j] == '_' || bytes[j] == '.')
            {
                j += 1;
            }
            let tok: String = bytes[i..j]
                .iter()
                .collect::<String>()
                .trim_end_matches('.')
                .to_string();
            out.push(tok);
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// The text files under `dir` (docs/ holds screenshots too: images are left out).
fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_none_or(|e| e != "png") {
            out.push(p);
        }
    }
}

/// Every metric name the dashboards and the READMEs use in Prometheus' spelling
/// (`hubguard_…`), as PromQL would ask for it.
pub(crate) fn promql_names() -> BTreeSet<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = Vec::new();
    files(&root.join("dashboards"), &mut paths);
    paths.push(root.join("README.md"));
    files(&root.join("docs"), &mut paths);
    let mut out = BTreeSet::new();
    for p in paths {
        let text = std::fs::read_to_string(&p).unwrap();
        out.extend(
            tokens(&text)
                .into_iter()
                .filter(|t| t.starts_with("hubguard_")),
        );
    }
    out
}

/// The sample names a Prometheus text exposition serves (`name{labels} value`).
pub(crate) fn served_names(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// Whether PromQL's `name` is served: as a sample name, or a histogram's family (its
/// `_bucket`, `_sum`, `_count` samples).
pub(crate) fn served(name: &str, names: &BTreeSet<String>) -> bool {
    names.contains(name) || names.contains(&format!("{name}_bucket"))
}

#[test]
fn dashboards_and_queries_name_only_what_the_code_emits() {
    let emitted: BTreeSet<String> = names::all().into_iter().map(normalise).collect();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = Vec::new();
    files(&root.join("dashboards"), &mut paths);
    paths.push(root.join("README.md"));
    files(&root.join("docs"), &mut paths);
    let mut checked = 0;
    for p in paths {
        let text = std::fs::read_to_string(&p).unwrap();
        for t in tokens(&text) {
            // Files, host names and the crate itself are not telemetry names.
            if [".toml", ".json", ".rs", ".yaml", ".md", ".com"]
                .iter()
                .any(|ext| t.ends_with(ext))
                || t == "hubguard"
                // Not telemetry: the label of the dead-letter queue's start-up probe message.
                || t == hubguard::pipeline::dead_letter::PROBE_LABEL
                // Not metrics: operational events' CloudEvents types (`com.hubguard.…`).
                || hubguard::opsevents::OpsEventKind::ALL
                    .iter()
                    .any(|k| k.type_name() == format!("com.{t}"))
            {
                continue;
            }
            assert!(
                known(&t, &emitted),
                "{} names `{t}`, which the code does not emit",
                p.display()
            );
            checked += 1;
        }
    }
    assert!(
        checked > 40,
        "the dashboards use the names ({checked} checked)"
    );
    // And the dashboard is valid JSON with its panels.
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("dashboards/grafana/hubguard.json")).unwrap(),
    )
    .unwrap();
    assert!(dash["panels"].as_array().unwrap().len() >= 10);
}

#[test]
fn the_check_catches_unknown_names() {
    let emitted: BTreeSet<String> = names::all().into_iter().map(normalise).collect();
    assert!(known("hubguard_events_delivered_total", &emitted));
    assert!(known("hubguard_retry_lateness_seconds_bucket", &emitted));
    assert!(known("hubguard.next_attempt_at", &emitted));
    assert!(known("hubguard_checkpoint_lag_seconds", &emitted));
    assert!(!known("hubguard_events_lost_total", &emitted));
    assert!(!known("hubguard.next_retry", &emitted));
    let names =
        served_names("# TYPE a_total counter\na_total{x=\"1\"} 3\nh_bucket{le=\"1\"} 1\nh_sum 2\n");
    assert!(served("a_total", &names) && served("h", &names) && served("h_bucket", &names));
    assert!(!served("b_total", &names));
    assert_eq!(
        tokens("x span.hubguard.outcome = 1 and hubguard_a_total."),
        vec!["hubguard.outcome", "hubguard_a_total"]
    );
}
