//! `hubguard bench --json`: everything one run measured, as one JSON line.

use super::{BenchArgs, Figures};

pub(super) fn json_line(args: &BenchArgs, f: &Figures) -> String {
    let mut fields = vec![
        format!("\"events\":{}", args.events),
        format!("\"event_bytes\":{}", args.size),
    ];
    for r in &f.eventhubs {
        fields.push(format!(
            "\"eventhubs_produce_per_s_p{}\":{:.0}",
            r.partitions, r.produce_per_s
        ));
        fields.push(format!(
            "\"eventhubs_consume_per_s_p{}\":{:.0}",
            r.partitions, r.consume_per_s
        ));
    }
    for g in &f.guard {
        fields.push(format!(
            "\"bare_per_s_p{}\":{:.0}",
            g.partitions, g.bare_per_s
        ));
        fields.push(format!(
            "\"guard_per_s_p{}\":{:.0}",
            g.partitions, g.guard_per_s
        ));
        fields.push(format!(
            "\"guard_vs_bare_ratio_p{}\":{:.3}",
            g.partitions,
            g.guard_per_s / g.bare_per_s
        ));
    }
    if let Some(g) = f.guard.last() {
        fields.push(format!(
            "\"guard_vs_bare_ratio\":{:.3}",
            g.guard_per_s / g.bare_per_s
        ));
        fields.push(format!(
            "\"checkpoint_writes_per_s\":{:.2}",
            g.checkpoint_writes_per_s
        ));
        fields.push(format!(
            "\"checkpoint_writes_bound_per_s\":{:.2}",
            g.checkpoint_writes_bound_per_s
        ));
        fields.push(format!(
            "\"happy_path_ops_per_event\":{:.4}",
            g.happy_path_ops_per_event
        ));
    }
    if let Some(c) = &f.concurrency {
        fields.push(format!("\"slow_handler_ms\":{}", c.delay.as_millis()));
        fields.push(format!("\"slow_per_s_in_flight_1\":{:.1}", c.one_per_s));
        fields.push(format!(
            "\"slow_per_s_in_flight_{}\":{:.1}",
            c.wide, c.wide_per_s
        ));
        fields.push(format!(
            "\"concurrency_speedup\":{:.2}",
            c.wide_per_s / c.one_per_s
        ));
    }
    if let Some(r) = &f.retries {
        fields.push(format!("\"retries_measured\":{}", r.retries));
        fields.push(format!(
            "\"schedule_latency_p50_ms\":{:.1}",
            r.schedule_ms.0
        ));
        fields.push(format!(
            "\"schedule_latency_p99_ms\":{:.1}",
            r.schedule_ms.1
        ));
        fields.push(format!("\"lateness_p50_ms\":{:.1}", r.lateness_ms.0));
        fields.push(format!("\"lateness_p99_ms\":{:.1}", r.lateness_ms.1));
    }
    if let Some(m) = &f.memory {
        fields.push(format!("\"pending_retries\":{}", m.pending));
        fields.push(format!("\"rss_mb_0_pending\":{:.1}", m.rss_idle_mb));
        fields.push(format!("\"rss_mb_warm\":{:.1}", m.rss_warm_mb));
        fields.push(format!("\"warm_pending_retries\":{}", m.warm_pending));
        fields.push(format!("\"rss_mb_pending\":{:.1}", m.rss_pending_mb));
        fields.push(format!(
            "\"rss_failure_path_fixed_mb\":{:.1}",
            m.rss_warm_mb - m.rss_idle_mb
        ));
        // Named after the default size; `pending_retries` says what was measured.
        fields.push(format!(
            "\"rss_growth_mb_100k_pending\":{:.1}",
            m.growth_per_pending_mb()
        ));
        let (lo, hi) = m.growth_range_mb();
        fields.push(format!("\"rss_growth_min_mb\":{lo:.1}"));
        fields.push(format!("\"rss_growth_max_mb\":{hi:.1}"));
        fields.push(format!(
            "\"rss_growth_readings\":{}",
            m.growth_readings_mb.len()
        ));
    }
    if let Some(a) = &f.azure {
        fields.push("\"profile\":\"azure\"".into());
        fields.push(format!("\"azure_partitions\":{}", a.partitions));
        fields.push(format!("\"azure_events\":{}", a.events));
        fields.push(format!("\"azure_handler_ms\":{}", a.handler.as_millis()));
        fields.push(format!("\"azure_max_in_flight\":{}", a.max_in_flight));
        fields.push(format!(
            "\"azure_retry_concurrency\":{}",
            a.retry_concurrency
        ));
        fields.push(format!(
            "\"azure_events_per_s_per_partition\":{:.0}",
            a.events_per_s_per_partition
        ));
        fields.push(format!(
            "\"azure_limit_per_s_per_partition\":{:.0}",
            a.limit_per_s()
        ));
        fields.push(format!("\"azure_limit_ratio\":{:.3}", a.limit_ratio()));
        fields.push(format!(
            "\"azure_failing_events_per_s_per_partition\":{:.0}",
            a.failing_events_per_s_per_partition
        ));
        fields.push(format!("\"azure_failure_ratio\":{:.3}", a.failure_ratio()));
        fields.push(format!("\"azure_retries\":{}", a.retries));
        fields.push(format!(
            "\"azure_retry_drain_per_s\":{:.0}",
            a.retry_drain_per_s
        ));
        fields.push(format!(
            "\"azure_retry_span_per_s\":{:.0}",
            a.retry_span_per_s
        ));
        fields.push(format!(
            "\"azure_retry_drain_ratio\":{:.3}",
            a.retry_drain_ratio()
        ));
        fields.push(format!(
            "\"azure_retry_lateness_p50_ms\":{:.0}",
            a.retry_lateness_ms.0
        ));
        fields.push(format!(
            "\"azure_retry_lateness_p99_ms\":{:.0}",
            a.retry_lateness_ms.1
        ));
    }
    for r in &f.scale {
        let name = format!(
            "scale_{}_{}",
            r.scenario.replace(' ', "_"),
            if r.handover { "handover" } else { "sdk" }
        );
        fields.push(format!("\"{name}_duplicates\":{}", r.duplicates));
        fields.push(format!("\"{name}_duplicate_pct\":{:.2}", r.duplicate_pct()));
        fields.push(format!("\"{name}_moves\":{}", r.moves));
        fields.push(format!("\"{name}_max_unread_ms\":{}", r.max_unread_ms));
    }
    if let Some(r) = &f.rate_limit {
        let (c, a) = (&r.cap, &r.adaptive);
        fields.push(format!("\"rate_limit_per_s\":{:.1}", c.limit));
        fields.push(format!("\"rate_limit_max_per_s\":{}", c.max_per_s));
        fields.push(format!(
            "\"rate_limit_max_ratio\":{:.3}",
            c.max_per_s as f64 / c.limit
        ));
        fields.push(format!(
            "\"rate_limit_events_per_s\":{:.1}",
            c.events as f64 / c.seconds.max(1e-9)
        ));
        fields.push(format!("\"adaptive_receiver_cap\":{}", a.cap.unwrap_or(0)));
        fields.push(format!("\"adaptive_max_per_s\":{}", a.max_per_s));
        fields.push(format!(
            "\"adaptive_max_per_s_after_30s\":{}",
            a.max_per_s_after_30s
        ));
        fields.push(format!(
            "\"adaptive_converged_at_s\":{}",
            a.converged_at_s.map_or("null".into(), |s| s.to_string())
        ));
        fields.push(format!(
            "\"adaptive_seconds_above_cap_after_30s\":{}",
            a.seconds_above_cap_after_30s
        ));
        fields.push(format!("\"adaptive_throttled\":{}", a.throttled));
        fields.push(format!("\"adaptive_dead_lettered\":{}", a.dead_lettered));
        fields.push(format!("\"adaptive_breaker_opens\":{}", a.breaker_opens));
        fields.push(format!("\"adaptive_decreases\":{}", a.decreases));
        fields.push(format!(
            "\"adaptive_events_per_s\":{:.1}",
            a.events as f64 / a.seconds.max(1e-9)
        ));
    }
    if let Some(c) = &f.cpu {
        fields.push(format!("\"cpu_us_per_event_guard\":{:.1}", c.guard_us));
        fields.push(format!("\"cpu_us_per_event_bare\":{:.1}", c.bare_us));
        fields.push(format!("\"cpu_per_event_ratio\":{:.3}", c.ratio()));
    }
    if let Some(l) = &f.ledger {
        fields.push(format!("\"ledger_settled\":{}", l.settled));
        fields.push(format!("\"ledger_pending\":{}", l.pending));
        fields.push(format!(
            "\"ledger_sweep_calls_settled\":{}",
            l.sweep_calls_settled
        ));
        fields.push(format!(
            "\"ledger_sweep_calls_empty\":{}",
            l.sweep_calls_empty
        ));
        fields.push(format!(
            "\"ledger_sweep_listed_settled\":{}",
            l.sweep_listed_settled
        ));
        fields.push(format!("\"retries_list_ms\":{:.1}", l.retries_list_ms));
        fields.push(format!(
            "\"retries_list_empty_ms\":{:.1}",
            l.retries_list_empty_ms
        ));
        let mb = |v: Option<f64>| v.map_or("null".to_string(), |v| format!("{v:.1}"));
        fields.push(format!(
            "\"ledger_sweep_peak_mb_settled\":{}",
            mb(l.sweep_peak_mb.0)
        ));
        fields.push(format!(
            "\"ledger_sweep_peak_mb_empty\":{}",
            mb(l.sweep_peak_mb.1)
        ));
        fields.push(format!(
            "\"ledger_retention_peak_mb_settled\":{}",
            mb(l.retention_peak_mb.0)
        ));
        fields.push(format!(
            "\"ledger_retention_peak_mb_empty\":{}",
            mb(l.retention_peak_mb.1)
        ));
    }
    if let Some(l) = &f.lines {
        fields.push(l.json());
    }
    if let Some(c) = &f.cost {
        for (name, _, ops) in c.paths() {
            fields.push(format!("\"{name}\":{}", ops.json()));
        }
        fields.push(format!("\"cost_lock_s\":{}", c.lock_s));
        fields.push(format!(
            "\"cost_renewed_attempt_s\":{}",
            c.retry_long_attempt_s
        ));
        let background: Vec<String> = c
            .background
            .iter()
            .map(|(k, n)| format!("\"{}\":{n}", k.name()))
            .collect();
        fields.push(format!(
            "\"cost_background\":{{\"seconds\":{:.1},{}}}",
            c.seconds,
            background.join(",")
        ));
    }
    format!("{{{}}}", fields.join(","))
}
