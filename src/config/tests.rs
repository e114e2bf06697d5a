use std::time::Duration;

use super::*;
use crate::pipeline::{OrderingKey, PipelineOptions};

const BASE: &str = r#"
[eventhubs]
connection_string = "Endpoint=sb://127.0.0.1:5672;SharedAccessKeyName=k;SharedAccessKey=TOPSECRET;UseDevelopmentEmulator=true"
hub = "hub"
[servicebus]
connection_string = "Endpoint=sb://127.0.0.1:5380;SharedAccessKeyName=k;SharedAccessKey=TOPSECRET;UseDevelopmentEmulator=true"
[storage]
container_url = "http://127.0.0.1:10000/devstoreaccount1/hubguard"
[handler]
kind = "webhook"
url = "http://127.0.0.1:9000/events"
"#;

fn none() -> Vec<(String, String)> {
    Vec::new()
}

#[test]
fn a_webhook_problem_names_its_key() {
    let err = |url: &str| {
        Config::parse(&BASE.replace("http://127.0.0.1:9000/events", url), none()).unwrap_err()
    };
    let e = err("ftp://127.0.0.1/events");
    assert_eq!(e.key(), Some("handler.url"), "{e}");
    assert!(e.to_string().contains("http or https"), "{e}");
    let e = Config::parse(
        &format!("{BASE}[handler.handshake]\nenabled = true\norigin = \" \"\n"),
        none(),
    )
    .unwrap_err();
    assert_eq!(e.key(), Some("handler.handshake.origin"), "{e}");
}

#[test]
fn the_example_file_parses() {
    let c = Config::parse(include_str!("../../hubguard.example.toml"), none()).unwrap();
    assert_eq!(c.eventhubs.hub, "hub");
    assert!(c.policy.types.contains_key("order.created"));
}

#[test]
fn the_dead_letter_queue_is_never_the_retry_queue_as_service_bus_compares_names() {
    let with = |retry: &str, dead: &str| {
        Config::parse(
            &format!(
                "{}[dead_letters]\nqueue = {dead:?}\n",
                BASE.replace("[storage]", &format!("queue = {retry:?}\n[storage]"))
            ),
            none(),
        )
    };
    // Different queues are fine, in any case.
    assert!(with("retries", "Dead-Letters").is_ok());
    assert!(with("orders/retries", "orders/dead-letters").is_ok());
    for (retry, dead) in [
        ("retries", "RETRIES"),
        ("Retries", "retries"),
        ("retries", " retries "),
        ("retries", "/retries/"),
        ("retries", "retries/$DeadLetterQueue"),
        ("retries", "RETRIES/$deadletterqueue"),
        ("orders/retries", "Orders/Retries/$DeadLetterQueue"),
        ("retries", "other/$DeadLetterQueue"),
        ("retries", "sb://NS.servicebus.windows.net/retries"),
        ("retries", ""),
    ] {
        let e = with(retry, dead).unwrap_err();
        let ConfigError::Invalid { key, message } = &e else {
            panic!("{retry} / {dead}: {e}")
        };
        assert_eq!(key, "dead_letters.queue", "{retry} / {dead}: {e}");
        assert!(message.contains("dead_letters.queue"), "{message}");
        assert!(!message.contains("TOPSECRET"), "{message}");
    }
}

#[test]
fn the_example_configuration_allows_a_thousand_events_per_s_per_partition_at_50_ms() {
    for text in [include_str!("../../hubguard.example.toml"), BASE] {
        let o = Config::parse(text, none())
            .unwrap()
            .pipeline_options()
            .unwrap();
        let handler = 0.050;
        assert!(
            o.max_in_flight as f64 / handler >= 1000.0,
            "max_in_flight {} with a 50 ms handler allows {} events/s",
            o.max_in_flight,
            o.max_in_flight as f64 / handler
        );
        assert_eq!(o.ordering, crate::pipeline::OrderingKey::PartitionKey);
        assert!(o.retry_concurrency as f64 / handler >= 1000.0);
        assert!(
            o.prefetch as usize >= o.max_in_flight,
            "prefetch keeps the slots fed"
        );
        assert!(
            o.window > o.max_in_flight,
            "settled events wait in the window, not in a slot"
        );
    }
    let o = Config::parse(&format!("{BASE}[processor]\nwindow = 512\n"), none())
        .unwrap()
        .pipeline_options()
        .unwrap();
    assert_eq!(o.window, 512);
    // The consumer's threads: one per core unless set.
    assert_eq!(o.partition_threads, 0);
    let o = Config::parse(&format!("{BASE}[processor]\nthreads = 3\n"), none())
        .unwrap()
        .pipeline_options()
        .unwrap();
    assert_eq!(o.partition_threads, 3);
    // Unset, the window follows the slots: raising max_in_flight for batches raises it.
    let o = Config::parse(&format!("{BASE}[processor]\nmax_in_flight = 500\n"), none())
        .unwrap()
        .pipeline_options()
        .unwrap();
    assert_eq!(o.window, 2000);
    let o = Config::parse(
        &format!("{BASE}[processor]\nmax_in_flight = 10000\n"),
        none(),
    )
    .unwrap()
    .pipeline_options()
    .unwrap();
    assert_eq!(o.window, 40_000);
    // A window set stays as set, even below the slots' default.
    let o = Config::parse(
        &format!("{BASE}[processor]\nmax_in_flight = 500\nwindow = 600\n"),
        none(),
    )
    .unwrap()
    .pipeline_options()
    .unwrap();
    assert_eq!(o.window, 600);
    let e = Config::parse(&format!("{BASE}[processor]\nwindow = 1000000\n"), none())
        .unwrap_err()
        .to_string();
    assert!(e.contains("processor.window"), "{e}");
    let e = Config::parse(&format!("{BASE}[processor]\nthreads = 5000\n"), none())
        .unwrap_err()
        .to_string();
    assert!(e.contains("processor.threads") && e.contains("1024"), "{e}");
}

#[test]
fn defaults_and_env_overrides() {
    let c = Config::parse(BASE, none()).unwrap();
    assert_eq!(c.servicebus.queue, "retries");
    assert_eq!(c.policy.default, RetryPolicy::seed_fibonacci());
    let env = vec![
        ("HUBGUARD_EVENTHUBS__HUB".to_string(), "orders".to_string()),
        (
            "HUBGUARD_POLICY__DEFAULT__MAX_ATTEMPTS".to_string(),
            "5".to_string(),
        ),
        (
            "HUBGUARD_CHECKPOINT__EVERY_MS".to_string(),
            "250".to_string(),
        ),
        ("HUBGUARD_EMULATOR_KEY".to_string(), "ignored".to_string()),
    ];
    let c = Config::parse(BASE, env).unwrap();
    assert_eq!(c.eventhubs.hub, "orders");
    assert_eq!(c.policy.default.max_attempts, 5);
    assert_eq!(c.checkpoint.every_ms, 250);
}

#[test]
fn errors_are_typed_by_where_the_problem_is() {
    let parse = |extra: &str, env: Vec<(String, String)>| {
        Config::parse(&format!("{BASE}{extra}"), env).unwrap_err()
    };
    let var = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
    assert!(matches!(
        Config::parse("[eventhubs\n", none()).unwrap_err(),
        ConfigError::Syntax(_)
    ));
    assert!(matches!(
        parse("", var("HUBGUARD_RETRY_CONCURRENCY", "4")),
        ConfigError::Environment { var, .. } if var == "HUBGUARD_RETRY_CONCURRENCY"
    ));
    let e = parse("", var("HUBGUARD_CHECKPOINT__EVERY_EVENTS", "abc"));
    assert_eq!(e.key(), Some("checkpoint.every_events"));
    assert!(matches!(
        &e,
        ConfigError::Value { env_var: Some(v), .. } if v == "HUBGUARD_CHECKPOINT__EVERY_EVENTS"
    ));
    let e = parse("[retry]\ncall_deadline_ms = 0\n", none());
    assert!(matches!(e, ConfigError::Invalid { .. }), "{e:?}");
    assert_eq!(e.key(), Some("retry.call_deadline_ms"));
    let e = Config::load(Path::new("/nonexistent/hubguard.toml"), none()).unwrap_err();
    assert!(matches!(e, ConfigError::Unreadable { .. }), "{e:?}");
    assert!(e.to_string().contains("/nonexistent/hubguard.toml"), "{e}");
}

#[test]
fn type_errors_and_impossible_values_name_the_key_or_the_variable() {
    let bad = |extra: &str, env: Vec<(String, String)>| {
        Config::parse(&format!("{BASE}{extra}"), env)
            .unwrap_err()
            .to_string()
    };
    let var = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
    for (extra, env, named) in [
        ("[checkpoint]\nevery_events = \"100\"\n", none(), "checkpoint.every_events"),
        ("", var("HUBGUARD_CHECKPOINT__EVERY_EVENTS", "abc"), "HUBGUARD_CHECKPOINT__EVERY_EVENTS"),
        ("timeout_ms = -5\n", none(), "timeout_ms"),
        (
            "[policy.default]\ncurve = \"fibonaci\"\nbase_s = 1\nfloor_s = 1\ncap_s = 9\nmax_attempts = 3\n",
            none(),
            "policy.default.curve",
        ),
        ("[status]\nlisten = \"localhost:eighty\"\n", none(), "status.listen"),
        ("timeout_ms = 0\n", none(), "handler.timeout_ms"),
        ("rate_limit = 0\n", none(), "handler.rate_limit"),
        ("rate_limit = -5.5\n", none(), "handler.rate_limit"),
        ("rate_limit = \"fast\"\n", none(), "handler.rate_limit"),
        ("", var("HUBGUARD_HANDLER__RATE_LIMIT", "0"), "handler.rate_limit"),
        ("[retry]\ncall_deadline_ms = 0\n", none(), "retry.call_deadline_ms"),
        ("[processor]\nprefetch = 0\n", none(), "processor.prefetch"),
        (
            "[policy.default]\ncurve = \"fixed\"\nbase_s = \"ten\"\nfloor_s = 1\ncap_s = 9\nmax_attempts = 3\n",
            none(),
            "base_s",
        ),
        ("[processor]\nupdate_interval_ms = 0\n", none(), "processor.update_interval_ms"),
        ("[status]\nmax_clock_skew_ms = 500\n", none(), "status.max_clock_skew_ms"),
        ("[status]\nmax_clock_skew_ms = 900001\n", none(), "status.max_clock_skew_ms"),
        ("", var("HUBGUARD_RETRY_CONCURRENCY", "4"), "HUBGUARD_RETRY_CONCURRENCY"),
    ] {
        let e = bad(extra, env);
        assert!(e.contains(named), "{named}: {e}");
    }
    let ftp = Config::parse(
        &BASE.replace("http://127.0.0.1:10000", "ftp://127.0.0.1:10000"),
        none(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        ftp.contains("storage.container_url") && ftp.contains("ftp"),
        "{ftp}"
    );
    // A number where the connection string goes names the key, never a value.
    let e = bad("", var("HUBGUARD_SERVICEBUS__CONNECTION_STRING", "12"));
    assert!(
        e.contains("HUBGUARD_SERVICEBUS__CONNECTION_STRING") && !e.contains("12"),
        "{e}"
    );
}

#[test]
fn secret_keys_are_redacted_and_others_keep_their_message() {
    assert!(is_secret_path("eventhubs.connection_string"));
    assert!(is_secret_path("storage.container_url"));
    assert!(is_secret_path("handler.signing.secret"));
    assert!(!is_secret_path("processor.ordering_key"));
    assert!(!is_secret_path("identity.idempotency_key_properties"));
    let e = Config::parse(&format!("{BASE}[processor]\nordering_key = 5\n"), none())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("processor.ordering_key") && e.contains("expected"),
        "{e}"
    );
}

#[test]
fn kubernetes_service_links_are_not_taken_for_overrides() {
    let env = vec![
        ("HUBGUARD_SERVICE_HOST".to_string(), "10.0.0.1".to_string()),
        ("HUBGUARD_SERVICE_PORT".to_string(), "8080".to_string()),
        (
            "HUBGUARD_SERVICE_PORT_STATUS".to_string(),
            "8080".to_string(),
        ),
        (
            "HUBGUARD_PORT".to_string(),
            "tcp://10.0.0.1:8080".to_string(),
        ),
        (
            "HUBGUARD_PORT_8080_TCP".to_string(),
            "tcp://10.0.0.1:8080".to_string(),
        ),
        (
            "HUBGUARD_PORT_8080_TCP_ADDR".to_string(),
            "10.0.0.1".to_string(),
        ),
    ];
    Config::parse(BASE, env).expect("service links are ignored");
}

#[test]
fn errors_name_the_key_and_never_the_secret() {
    let bad = |extra: &str| {
        Config::parse(&format!("{BASE}{extra}"), none())
            .unwrap_err()
            .to_string()
    };
    let e = bad("[checkpoint]\nevry_ms = 5\n");
    assert!(e.contains("evry_ms"), "{e}");
    let e = bad("[policy.default]\ncurve = \"fibonacci\"\nmax_attempts = 0\n");
    assert!(
        e.contains("policy.default") && e.contains("max_attempts"),
        "{e}"
    );
    let e = bad("[policy.types.\"x\"]\ncurve = \"fixed\"\nmax_attempts = 3\nbase = 4\n");
    assert!(
        e.contains("policy.types.\"x\"") && e.contains("`base`"),
        "{e}"
    );
    let e = bad("[processor]\nownership_expiration_ms = 100\nupdate_interval_ms = 200\n");
    assert!(e.contains("ownership_expiration_ms"), "{e}");
    let e = Config::parse(&BASE.replace("SharedAccessKeyName=k;", ""), none())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("eventhubs.connection_string") && e.contains("SharedAccessKeyName"),
        "{e}"
    );
    assert!(!e.contains("TOPSECRET"));
    let e = Config::parse(
        &BASE.replace("hub = \"hub\"", "hub = \"hub\"\nhub = \"x\""),
        none(),
    )
    .unwrap_err()
    .to_string();
    assert!(!e.contains("TOPSECRET"), "{e}");
    let e = bad("[servicebus_extra]\n");
    assert!(e.contains("servicebus_extra"), "{e}");
    // Debug output (which may reach a log or a panic) redacts the secrets too.
    let c = Config::parse(BASE, none()).unwrap();
    assert!(!format!("{c:?}").contains("TOPSECRET"));
}

#[test]
fn a_breaker_open_longer_than_retention_is_refused() {
    let c = format!("{BASE}[breaker]\nopen_ms = 90000000\n");
    let e = Config::parse(&c, none()).unwrap_err().to_string();
    assert!(
        e.contains("breaker.open_ms") && e.contains("retention"),
        "{e}"
    );
    let off = format!("{BASE}[breaker]\nenabled = false\nopen_ms = 90000000\n");
    assert!(Config::parse(&off, none()).is_ok());
}

#[test]
fn a_short_duplicate_window_is_refused() {
    let c = BASE.replace("[storage]", "duplicate_detection_window_s = 30\n[storage]");
    let e = Config::parse(&c, none()).unwrap_err().to_string();
    assert!(e.contains("duplicate_detection_window_s"), "{e}");
}
#[test]
fn the_duplicate_window_covers_a_redelivered_retry_as_the_queue_proof_does() {
    // A short replay gap (1 s + 10 s + 4 × 10 s + 60 s = 111 s), shorter than a
    // redelivered retry's re-send (60 s lock + 4 × 10 s + 60 s = 160 s): the window must
    // cover the longer, as `QueueNeeds::window` requires at start-up.
    let with_window = |s: u64| {
        BASE.replace(
            "[storage]",
            &format!("duplicate_detection_window_s = {s}\n[storage]"),
        ) + "[checkpoint]\nevery_ms = 1000\nmin_interval_ms = 500\n[processor]\nupdate_interval_ms = 2000\nownership_expiration_ms = 10000\n[retry]\ncall_deadline_ms = 10000\n"
    };
    let c = Config::parse(&with_window(160), none()).unwrap();
    assert_eq!(c.replay_gap(), Duration::from_secs(111));
    assert_eq!(c.queue_needs().window(None), Duration::from_secs(160));
    let e = Config::parse(&with_window(120), none()).unwrap_err();
    assert_eq!(e.key(), Some("servicebus.duplicate_detection_window_s"));
    let e = e.to_string();
    assert!(e.contains("(120)") && e.contains("needs (160 s"), "{e}");
}

#[test]
fn start_and_ordering_key_are_read_once_into_their_types() {
    let c = Config::parse(
        &(BASE.to_string()
            + "[processor]\nstart = \"latest\"\nordering_key = \"property:order\"\n"),
        none(),
    )
    .unwrap();
    assert_eq!(c.processor.start, StartPosition::Latest);
    assert_eq!(
        c.processor.ordering_key,
        OrderingKey::Property("order".into())
    );
    let o = c.pipeline_options().unwrap();
    assert!(o.start_at_latest);
    assert_eq!(o.ordering, OrderingKey::Property("order".into()));
    let e = Config::parse(
        &(BASE.to_string() + "[processor]\nordering_key = \"colour\"\n"),
        none(),
    )
    .unwrap_err();
    assert_eq!(e.key(), Some("processor.ordering_key"));
    assert!(e.to_string().contains("property:<name>"), "{e}");
    let e = Config::parse(
        &(BASE.to_string() + "[processor]\nstart = \"middle\"\n"),
        none(),
    )
    .unwrap_err();
    assert_eq!(e.key(), Some("processor.start"));
    assert!(e.to_string().contains("earliest"), "{e}");
}

#[test]
fn ordered_retries_are_off_unless_asked_for_and_checked() {
    use crate::pipeline::{LineOnDeadLetter, RetryOrdering};
    let o = Config::parse(BASE, none())
        .unwrap()
        .pipeline_options()
        .unwrap();
    assert_eq!(o.retry_ordering, RetryOrdering::Off, "today's behaviour");
    let on = |extra: &str| {
        Config::parse(&format!("{BASE}[processor]\n{extra}"), none())
            .and_then(|c| c.pipeline_options())
    };
    assert_eq!(
        on("retry_ordering = \"key\"\n").unwrap().retry_ordering,
        RetryOrdering::Key(LineOnDeadLetter::Release)
    );
    assert_eq!(
        on("retry_ordering = \"key\"\nline_on_dead_letter = \"dead_letter_line\"\n")
            .unwrap()
            .retry_ordering,
        RetryOrdering::Key(LineOnDeadLetter::DeadLetterLine)
    );
    let e = on("retry_ordering = \"strict\"\n").unwrap_err().to_string();
    assert!(
        e.contains("processor.retry_ordering") && e.contains("`key`"),
        "{e}"
    );
    let e = on("retry_ordering = \"key\"\nline_on_dead_letter = \"drop\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("processor.line_on_dead_letter"), "{e}");
    let e = on("retry_ordering = \"key\"\nordering_key = \"none\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("processor.ordering_key is `none`"), "{e}");
}

#[test]
fn concurrency_and_checkpoint_pacing_are_configured_and_checked() {
    let c = Config::parse(
        &format!("{BASE}[processor]\nmax_in_flight = 32\nordering_key = \"property:order_id\"\n[checkpoint]\nmin_interval_ms = 250\n"),
        none(),
    )
    .unwrap();
    let o = c.pipeline_options().unwrap();
    assert_eq!(o.max_in_flight, 32);
    assert_eq!(
        o.ordering,
        crate::pipeline::OrderingKey::Property("order_id".into())
    );
    assert_eq!(o.checkpoint_min_interval, Duration::from_millis(250));
    let defaults = Config::parse(BASE, none()).unwrap();
    assert_eq!(
        defaults.processor.max_in_flight, DEFAULT_MAX_IN_FLIGHT,
        "sized for a web downstream unless told"
    );
    let bad = |extra: &str| {
        Config::parse(&format!("{BASE}{extra}"), none())
            .unwrap_err()
            .to_string()
    };
    let e = bad("[processor]\nmax_in_flight = 0\n");
    assert!(e.contains("processor.max_in_flight"), "{e}");
    let e = bad("[processor]\nordering_key = \"customer\"\n");
    assert!(
        e.contains("processor.ordering_key") && e.contains("property:<name>"),
        "{e}"
    );
    let e = bad("[checkpoint]\nevery_ms = 100\nmin_interval_ms = 500\n");
    assert!(e.contains("checkpoint.min_interval_ms"), "{e}");
    let e = bad("[retry]\ndead_letter_sweep_ms = 0\n");
    assert!(e.contains("retry.dead_letter_sweep_ms"), "{e}");
    let e = bad("[retry]\nprefetch = 0\n");
    assert!(e.contains("retry.prefetch"), "{e}");
    let o = Config::parse(
        &format!("{BASE}[retry]\nlead_ms = 0\nprefetch = 64\n"),
        none(),
    )
    .unwrap()
    .pipeline_options()
    .unwrap();
    assert_eq!((o.retry_lead, o.retry_prefetch), (Duration::ZERO, 64));
    let o = defaults.pipeline_options().unwrap();
    let d = PipelineOptions::default();
    assert_eq!(
        (o.retry_lead, o.retry_prefetch),
        (d.retry_lead, d.retry_prefetch)
    );
    let e = Config::parse(
        BASE,
        vec![("HUBGUARD_PROCESSOR__MAX_IN_FLIGHT".into(), "8".into())],
    )
    .unwrap();
    assert_eq!(e.processor.max_in_flight, 8, "environment override");
}

#[test]
fn operational_events_take_one_destination_and_sane_windows() {
    let with =
        |section: &str| Config::parse(&format!("{BASE}[operational_events]\n{section}"), none());
    let c = with("url = \"https://ops.example.com/h\"\nsuppression_ms = 60000\n").unwrap();
    let o = c.operational_events.as_ref().unwrap();
    assert_eq!(o.settings().suppression, Duration::from_secs(60));
    assert_eq!(o.held_longer_than_ms, 300_000);
    assert_eq!(o.queue_size, 256);
    assert!(with("queue = \"hubguard-ops\"\n").is_ok());
    for (section, key) in [
        ("", "operational_events"),
        (
            "url = \"https://a/\"\nqueue = \"q\"\n",
            "operational_events",
        ),
        ("url = \"ftp://a/\"\n", "operational_events.url"),
        ("queue = \"RETRIES\"\n", "operational_events.queue"),
        (
            "queue = \"retries/$DeadLetterQueue\"\n",
            "operational_events.queue",
        ),
        (
            "queue = \"q\"\nsigning = { env = \"X\" }\n",
            "operational_events.signing",
        ),
        (
            "url = \"https://a/\"\nsuppression_ms = 10\n",
            "operational_events.suppression_ms",
        ),
        (
            "url = \"https://a/\"\nheld_longer_than_ms = 0\n",
            "operational_events.held_longer_than_ms",
        ),
        (
            "url = \"https://a/\"\nqueue_size = 0\n",
            "operational_events.queue_size",
        ),
        (
            "url = \"https://a/\"\nqueue_size = 100000\n",
            "operational_events.queue_size",
        ),
        (
            "url = \"https://a/\"\ntimeout_ms = 1\n",
            "operational_events.timeout_ms",
        ),
    ] {
        let e = with(section).unwrap_err();
        assert_eq!(e.key(), Some(key), "{section}: {e}");
    }
    // A URL's credentials never show in the error.
    let e = with("url = \"ftp://user:TOPSECRET@a/\"\n").unwrap_err();
    assert!(!e.to_string().contains("TOPSECRET"), "{e}");
}

#[test]
fn the_backlog_interval_has_a_floor() {
    let e = Config::parse(&format!("{BASE}[status]\nbacklog_every_ms = 10\n"), none()).unwrap_err();
    assert_eq!(e.key(), Some("status.backlog_every_ms"), "{e}");
    let o = Config::parse(
        &format!("{BASE}[status]\nbacklog_every_ms = 5000\n"),
        none(),
    )
    .unwrap()
    .pipeline_options()
    .unwrap();
    assert_eq!(o.backlog_every, Duration::from_secs(5));
}

#[test]
fn the_console_is_on_by_default_and_its_settings_are_checked() {
    let c = Config::parse(BASE, none()).unwrap();
    assert!(c.console.enabled && c.console.operator_token.is_none());
    let var = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
    // A token from the environment, never shown by Debug.
    let c = Config::parse(
        BASE,
        var("HUBGUARD_CONSOLE__OPERATOR_TOKEN", "S3CRET-console-token"),
    )
    .unwrap();
    assert_eq!(
        c.console.operator_token.as_deref(),
        Some("S3CRET-console-token")
    );
    assert!(!format!("{c:?}").contains("S3CRET"));
    let bad = |extra: &str| {
        Config::parse(&format!("{BASE}[console]\n{extra}"), none())
            .unwrap_err()
            .to_string()
    };
    for (extra, named) in [
        (
            "trace_url = \"javascript:alert(1)//{trace_id}\"\n",
            "console.trace_url",
        ),
        (
            "trace_url = \"http://jaeger:16686/search\"\n",
            "console.trace_url",
        ),
        (
            "trusted_user_header = \"X-User\"\n",
            "console.trusted_user_header",
        ),
        ("operators = [\"alice\"]\n", "console.operators"),
        (
            "operator_token = \"a\"\noperator_token_file = \"/x\"\n",
            "console.operator_token",
        ),
        (
            "allowed_origins = [\"https://x.example/path\"]\n",
            "console.allowed_origins",
        ),
        ("enabled = \"yes\"\n", "console.enabled"),
    ] {
        let e = bad(extra);
        assert!(e.contains(named), "{named}: {e}");
    }
    // A token in the file is never quoted in an error about it.
    let e = bad("operator_token = 5\n");
    assert!(
        e.contains("console.operator_token") && !e.contains('5'),
        "{e}"
    );
    let ok = format!(
        "{BASE}[console]\ntrace_url = \"http://jaeger:16686/trace/{{trace_id}}\"\ntrusted_user_header = \"X-Auth-Request-Email\"\noperators = [\"alice@example.com\"]\nallowed_origins = [\"https://hubguard.example.com\"]\n"
    );
    assert!(Config::parse(&ok, none()).is_ok());
}

#[test]
fn an_event_types_storm_guard_thresholds_are_read_and_a_bad_one_names_its_key() {
    let c = format!(
        "{BASE}[storm_guard]\nheld_retry_defer_max_ms = 60000\n[storm_guard.event_types.\"bulk.imported\"]\nshare = 0.9\nmin_refusals = 50\n[storm_guard.event_types.\"audit\"]\nenabled = false\n"
    );
    let c = Config::parse(&c, none()).unwrap();
    let g = &c.storm_guard;
    assert_eq!(g.held_retry_defer_max_ms, 60_000);
    assert_eq!(g.lane_of(Some("bulk.imported")), Some("bulk.imported"));
    let bulk = g.lane(Some("bulk.imported"));
    assert_eq!(
        (bulk.share, bulk.min_refusals, bulk.window_ms),
        (0.9, 50, 60_000)
    );
    assert!(!g.covers(Some("audit")));
    for (toml, key) in [
        (
            "[storm_guard.event_types.\"bulk\"]\nshare = 2.0\n",
            "storm_guard.event_types.\"bulk\".share",
        ),
        (
            "[storm_guard.event_types.\"bulk\"]\nenabled = false\nwindow_ms = 5000\n",
            "storm_guard.event_types.\"bulk\".enabled",
        ),
        (
            "[storm_guard]\nheld_retry_defer_max_ms = 1000\n",
            "storm_guard.held_retry_defer_max_ms",
        ),
        (
            "[storm_guard.event_types.\"bulk\"]\nmin_refusal = 5\n",
            "min_refusal",
        ),
    ] {
        let e = Config::parse(&format!("{BASE}{toml}"), none()).unwrap_err();
        assert!(e.to_string().contains(key), "{toml}: {e}");
    }
}
