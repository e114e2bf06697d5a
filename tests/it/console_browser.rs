//! The console in a real browser: headless Chromium driven through WebDriver (Debian's
//! `chromium` and `chromium-driver`; `.ci/run` installs them and sets
//! `HUBGUARD_REQUIRE_BROWSER=1`, without which a machine lacking them skips these tests).
//! Screenshots are kept in `target/console-screenshots/`.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use base64::Engine as _;
use hubguard::ledger::State;
use serde_json::{json, Value};

use crate::common::*;
use crate::console::{ConsoleBed, LIMIT, OPERATOR_TOKEN};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// `Some((chromium, chromedriver))`, or `None` (and a note) when missing and not required.
fn browser_or_skip() -> Option<(String, String)> {
    let find = |names: &[&str]| {
        names.iter().find_map(|n| {
            ["/usr/bin", "/usr/local/bin", "/usr/lib/chromium"]
                .iter()
                .map(|d| format!("{d}/{n}"))
                .find(|p| std::path::Path::new(p).exists())
        })
    };
    match (
        find(&["chromium", "chromium-browser"]),
        find(&["chromedriver"]),
    ) {
        (Some(b), Some(d)) => Some((b, d)),
        _ => {
            assert!(
                std::env::var("HUBGUARD_REQUIRE_BROWSER").is_err(),
                "HUBGUARD_REQUIRE_BROWSER is set but chromium or chromedriver is missing (apt-get install chromium chromium-driver)"
            );
            eprintln!("skipped: chromium and chromium-driver are not installed");
            None
        }
    }
}

/// A WebDriver session on a chromedriver this test started.
struct Browser {
    driver: tokio::process::Child,
    base: String,
    session: String,
    http: reqwest::Client,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start(chromium: &str, chromedriver: &str) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = tokio::process::Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        eventually("chromedriver answers", LIMIT, || {
            let (http, base) = (http.clone(), base.clone());
            async move { http.get(format!("{base}/status")).send().await.is_ok() }
        })
        .await;
        let profile = tempfile::tempdir().unwrap();
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": { "binary": chromium, "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=412,915", format!("--user-data-dir={}", profile.path().display()),
            ]}
        }}});
        let mut b = Self {
            driver,
            base,
            session: String::new(),
            http,
            _profile: profile,
        };
        let v = b.call("POST", "/session", Some(caps)).await;
        b.session = v["sessionId"].as_str().expect("a session").to_string();
        b
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = if path == "/session" {
            format!("{}{path}", self.base)
        } else {
            format!("{}/session/{}{path}", self.base, self.session)
        };
        let mut req = self.http.request(method.parse().unwrap(), url);
        if let Some(b) = body {
            req = req
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let text = within(path, async {
            req.send().await.unwrap().text().await.unwrap()
        })
        .await;
        serde_json::from_str::<Value>(&text).unwrap()["value"].clone()
    }

    async fn open(&self, url: &str) {
        self.call("POST", "/url", Some(json!({ "url": url }))).await;
    }

    /// Loads the page again (opening the URL it shows would only move to its fragment).
    async fn reload(&self) {
        self.call("POST", "/refresh", Some(json!({}))).await;
    }

    async fn find(&self, css: &str) -> Option<String> {
        let v = self
            .call(
                "POST",
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await;
        v[ELEMENT].as_str().map(str::to_string)
    }

    /// Waits for the element `css` whose text satisfies `ok`; its text.
    async fn text_of(&self, css: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
        eventually(what, LIMIT, || async {
            let text = match self.find(css).await {
                Some(e) => self.call("GET", &format!("/element/{e}/text"), None).await,
                None => Value::Null,
            };
            seen(text.as_str().unwrap_or("").to_string(), |t| ok(t))
        })
        .await
    }

    /// Waits for the element `css` whose text satisfies `ok`, loading the page again between
    /// looks (for what the page shows only when it loads: a replica's state that follows an
    /// action within its poll).
    async fn text_reloading(&self, css: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
        Wait::new(what, LIMIT)
            .every(Duration::from_millis(500))
            .until(|| async {
                let text = match self.find(css).await {
                    Some(e) => self.call("GET", &format!("/element/{e}/text"), None).await,
                    None => Value::Null,
                };
                let text = text.as_str().unwrap_or("").to_string();
                if !ok(&text) {
                    self.call("POST", "/refresh", Some(json!({}))).await;
                }
                seen(text, |t| ok(t))
            })
            .await
    }

    async fn click(&self, css: &str) {
        let e = eventually(&format!("{css} is there"), LIMIT, || self.find(css)).await;
        self.call("POST", &format!("/element/{e}/click"), Some(json!({})))
            .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let e = eventually(&format!("{css} is there"), LIMIT, || self.find(css)).await;
        self.call("POST", &format!("/element/{e}/clear"), Some(json!({})))
            .await;
        self.call(
            "POST",
            &format!("/element/{e}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    async fn script(&self, script: &str) -> Value {
        self.call(
            "POST",
            "/execute/sync",
            Some(json!({ "script": script, "args": [] })),
        )
        .await
    }

    async fn attribute(&self, css: &str, name: &str) -> String {
        let e = eventually(&format!("{css} is there"), LIMIT, || self.find(css)).await;
        let v = self
            .call("GET", &format!("/element/{e}/attribute/{name}"), None)
            .await;
        v.as_str().unwrap_or("").to_string()
    }

    /// Answers a `prompt()` the page opened.
    async fn answer_prompt(&self, text: &str) {
        eventually("a prompt is open", LIMIT, || async {
            self.call("GET", "/alert/text", None).await.is_string()
        })
        .await;
        self.call("POST", "/alert/text", Some(json!({ "text": text })))
            .await;
        self.call("POST", "/alert/accept", Some(json!({}))).await;
    }

    /// Whether an alert is open (a script the page should never have run).
    async fn alert_open(&self) -> bool {
        self.call("GET", "/alert/text", None).await.is_string()
    }

    async fn screenshot(&self, name: &str) {
        let v = self.call("GET", "/screenshot", None).await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap();
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/console-screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
    }

    async fn quit(mut self) {
        let _ = self.call("DELETE", "", None).await;
        let _ = self.driver.kill().await;
    }
}

/// The console's own address for a page path.
fn page(cb: &ConsoleBed, path: &str) -> String {
    format!("http://{}/console/{path}", cb.addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn support_staff_find_when_a_key_retries_and_then_that_it_was_delivered() {
    let Some((chromium, driver)) = browser_or_skip() else {
        return;
    };
    let cb = ConsoleBed::start().await;
    let xss = "<img src=x onerror=alert(1)>";
    cb.bed.send(0, &[("s-1", "fail:1"), (xss, "fail:1")]).await;
    cb.until_state("s-1", State::RetryScheduled).await;
    cb.until_state(xss, State::RetryScheduled).await;
    let b = Browser::start(&chromium, &driver).await;
    b.open(&page(&cb, "")).await;
    b.type_into("#q", "s-1").await;
    b.click("#lookup").await;
    let next = b
        .text_of("#next-attempt", "the next attempt", |t| t.contains("UTC"))
        .await;
    assert!(
        next.starts_with("Next attempt (2 of 4) in 1 min") || next.contains("in 2 min"),
        "{next}"
    );
    let link = b.attribute(".trace-link", "href").await;
    assert!(link.starts_with("http://tempo.example/trace/"), "{link}");
    b.text_of("#gives-up", "when it gives up", |t| t.contains("attempt 4"))
        .await;
    b.screenshot("support-key-waiting").await;
    // The retry comes due and is delivered; the page says so.
    cb.bed.clock().advance(Duration::from_secs(121));
    cb.until_state("s-1", State::Delivered).await;
    b.click("#lookup").await;
    b.text_of("#story .state", "delivered", |t| t == "DELIVERED")
        .await;
    b.screenshot("support-key-delivered").await;
    // A key that is markup is shown as text: no element made of it, no script run.
    b.type_into("#q", xss).await;
    b.click("#lookup").await;
    b.text_of("#story .key", "the key as text", |t| t == xss)
        .await;
    assert_eq!(
        b.script("return document.querySelectorAll('img').length")
            .await,
        0
    );
    assert!(!b.alert_open().await, "the key's markup ran");
    b.screenshot("support-key-markup-as-text").await;
    b.quit().await;
    cb.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_replay_a_group_and_pause_a_partition_and_forgeries_are_refused() {
    let Some((chromium, driver)) = browser_or_skip() else {
        return;
    };
    let cb = ConsoleBed::start().await;
    cb.bed
        .send(1, &[("d-1", "ok"), ("d-2", "ok"), ("d-3", "ok")])
        .await;
    cb.bed.send(0, &[("w-1", "fail:1")]).await;
    cb.until_state("d-3", State::DeadLettered).await;
    cb.until_state("w-1", State::RetryScheduled).await;
    let b = Browser::start(&chromium, &driver).await;
    // Without the operator role: the buttons are off, and the API refuses.
    b.open(&page(&cb, "#key=w-1")).await;
    b.text_of("#next-attempt", "the key page", |t| t.contains("UTC"))
        .await;
    let refused = b
        .script("var x = new XMLHttpRequest(); x.open('POST', '/console/api/act/retry-now', false); x.setRequestHeader('content-type', 'application/json'); x.send('{\"key\":\"w-1\"}'); return x.status;")
        .await;
    assert_eq!(refused, 403);
    // A page of another site posting a form at the console is refused.
    let evil = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let evil_port = evil.local_addr().unwrap().port();
    let target = format!("http://{}/console/api/act/pause", cb.addr);
    let html = format!("<form id=f method=POST action='{target}' enctype='text/plain'><input name='{{\"partitions\":[\"1\"],\"x\":\"' value='\"}}'></form><script>document.getElementById('f').submit()</script>");
    let evil_server = tokio::spawn(async move {
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(move || async move { axum::response::Html(html) }),
        );
        axum::serve(evil, app).await.unwrap();
    });
    b.open(&format!("http://localhost:{evil_port}/")).await;
    let addr = cb.addr.clone();
    eventually("the forged pause is refused and audited", LIMIT, || {
        let addr = addr.clone();
        async move {
            let v: Value = reqwest::get(format!("http://{addr}/console/api/audit"))
                .await
                .unwrap()
                .json_value()
                .await;
            v["entries"].as_array().is_some_and(|e| {
                e.iter().any(|e| {
                    e["action"] == "pause"
                        && e["outcome"].as_str().unwrap_or("").contains("another site")
                })
            })
        }
    })
    .await;
    evil_server.abort();
    // Sign in as an operator.
    b.open(&page(&cb, "#dead")).await;
    b.click("#signin summary").await;
    b.type_into("#token", OPERATOR_TOKEN).await;
    b.click("#signin-form button").await;
    b.text_of("#who", "signed in", |t| t.contains("operator"))
        .await;
    // The group of three: a dry run, then a replay at a rate, to delivered.
    b.text_of("#group-0 .big", "the group", |t| {
        t.starts_with("3 × permanent · status 422")
    })
    .await;
    b.screenshot("operator-dead-letter-groups").await;
    b.click("#group-0 .actions button").await;
    b.text_of("#job-text", "the dry run", |t| {
        t.contains("3 would be replayed") && t.contains("finished")
    })
    .await;
    cb.handler.refuse.store(false, Ordering::SeqCst);
    b.type_into("#group-0 .rate", "5").await;
    b.click("#group-0 .replay").await;
    b.text_of("#job-text", "the replay", |t| {
        t.contains("3 replayed") && t.contains("finished")
    })
    .await;
    b.screenshot("operator-replay-done").await;
    for k in ["d-1", "d-2", "d-3"] {
        cb.until_state(k, State::Delivered).await;
    }
    // Pause partition 1, then resume it.
    b.open(&page(&cb, "#partitions")).await;
    b.click("#partition-1 button").await;
    b.answer_prompt("maintenance").await;
    b.text_of("#partition-1", "paused", |t| {
        t.contains("paused by operator (token)") && t.contains("maintenance")
    })
    .await;
    b.screenshot("operator-partition-paused").await;
    b.click("#partition-1 button").await;
    // The action changes the control record at once (the pause column); the replica follows
    // at its next read of the record (every 2 s), which a fresh page shows (the held column).
    b.text_of("#partition-1 td:nth-child(6)", "resumed", |t| t.is_empty())
        .await;
    eventually("the replica resumed partition 1", LIMIT, || async {
        b.reload().await;
        let row = b
            .text_of("#partition-1", "the row", |t| !t.is_empty())
            .await;
        seen(row, |t| !t.contains("paused by"))
    })
    .await;
    // Pause the retries of w-1 from the retries page: the row and the list of pauses say
    // who and why; resume it from the list.
    b.open(&page(&cb, "#retries")).await;
    b.text_of("#retries tbody", "w-1 waits", |t| t.contains("w-1"))
        .await;
    b.click("#retries tbody tr button").await;
    b.answer_prompt("receiver fix").await;
    b.text_of("#retry-pauses", "the pause listed", |t| {
        t.contains("retries of key w-1: paused by operator (token)") && t.contains("receiver fix")
    })
    .await;
    b.text_of("#retries tbody", "the row paused", |t| {
        t.contains("paused by operator (token)")
    })
    .await;
    b.screenshot("operator-retries-paused").await;
    b.click("#retry-pauses button").await;
    b.text_of("#retries tbody", "the row resumed", |t| {
        t.contains("w-1") && !t.contains("paused by")
    })
    .await;
    b.open(&page(&cb, "#audit")).await;
    b.text_of("#audit", "the audit trail", |t| {
        t.contains("resume") && t.contains("replay-job") && t.contains("resume-retries")
    })
    .await;
    b.screenshot("operator-audit").await;
    assert!(!cb.handler.inner.delivered_keys().is_empty());
    b.quit().await;
    cb.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_rewind_a_paused_partition_and_its_events_are_delivered_again() {
    let Some((chromium, driver)) = browser_or_skip() else {
        return;
    };
    let cb = ConsoleBed::start().await;
    cb.bed
        .send(0, &[("r-0", "ok"), ("r-1", "ok"), ("r-2", "ok")])
        .await;
    eventually("delivered and checkpointed", LIMIT, || async {
        cb.handler.inner.delivered_keys().len() == 3 && cb.bed.checkpoint_of("0").await == Some(2)
    })
    .await;
    let b = Browser::start(&chromium, &driver).await;
    b.open(&page(&cb, "#partitions")).await;
    b.click("#signin summary").await;
    b.type_into("#token", OPERATOR_TOKEN).await;
    b.click("#signin-form button").await;
    b.text_of("#who", "signed in", |t| t.contains("operator"))
        .await;
    // Owned and read: refused by the command line's check, nothing written.
    b.type_into("#rw-partitions", "0").await;
    b.type_into("#rw-sequence", "1").await;
    b.click("#rw-dry").await;
    b.text_of("#rewind-card", "refused while read", |t| {
        t.contains("refused") && t.contains("not paused")
    })
    .await;
    // Paused, a dry run says what would be delivered again; then the rewind.
    b.click("#partition-0 button").await;
    b.answer_prompt("rewind after the bad deploy").await;
    b.text_of("#partition-0", "paused", |t| t.contains("paused by"))
        .await;
    b.click("#rw-dry").await;
    b.text_of("#rewind-card", "the dry run", |t| {
        t.contains("would be rewound") && t.contains("from sequence number 1 (2 events)")
    })
    .await;
    assert_eq!(
        cb.bed.checkpoint_of("0").await,
        Some(2),
        "a dry run writes nothing"
    );
    b.click("#rw-go").await;
    b.text_of("#rewind-card", "the rewind asked for", |t| {
        t.contains("waiting for its owner replica-a") || t.contains("applied by replica-a")
    })
    .await;
    // The owner applies it: the partitions page says so once it has.
    let addr = cb.addr.clone();
    eventually("the owner applied the rewind", LIMIT, || {
        let addr = addr.clone();
        async move {
            let v: Value = reqwest::get(format!("http://{addr}/console/api/overview"))
                .await
                .unwrap()
                .json_value()
                .await;
            v["control"]["rewinds"]["0"]["applied"]["by"] == "replica-a"
        }
    })
    .await;
    assert_eq!(cb.bed.checkpoint_of("0").await, Some(0));
    b.text_reloading("#partition-0", "rewound", |t| {
        t.contains("from sequence 1") && t.contains("applied by replica-a")
    })
    .await;
    b.screenshot("operator-partition-rewound").await;
    // Resumed, it reads again from the rewound position: r-1 and r-2 again, r-0 not.
    b.click("#partition-0 button").await;
    eventually("delivered again from sequence number 1", LIMIT, || async {
        cb.handler.inner.calls_of("r-1").len() == 2 && cb.handler.inner.calls_of("r-2").len() == 2
    })
    .await;
    assert_eq!(cb.handler.inner.calls_of("r-0"), vec![1]);
    b.open(&page(&cb, "#audit")).await;
    b.text_of("#audit", "the rewind audited", |t| {
        t.contains("rewind (dry run)") && t.contains("waiting for their owner")
    })
    .await;
    b.quit().await;
    cb.stop().await;
}

/// `json()` without reqwest's `json` feature.
trait JsonValue {
    async fn json_value(self) -> Value;
}

impl JsonValue for reqwest::Response {
    async fn json_value(self) -> Value {
        serde_json::from_str(&self.text().await.unwrap()).unwrap_or(Value::Null)
    }
}
