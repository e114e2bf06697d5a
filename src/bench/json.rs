//! `hubguard bench --json`: everything one run measured, as one JSON line.

use super::{
    azure, cost, cpu, ledger, memory, pipelines, ratelimit, scale, BenchArgs, Figures,
    GuardFigures, Throughput,
};

/// Everything one run measured as one JSON object: the options, then each scenario's figures.
pub(super) fn json_line(args: &BenchArgs, f: &Figures) -> String {
    let mut fields = vec![
        format!("\"events\":{}", args.events),
        format!("\"event_bytes\":{}", args.size),
    ];
    fields.extend(eventhubs_fields(&f.eventhubs));
    fields.extend(guard_fields(&f.guard));
    if let Some(c) = &f.concurrency {
        fields.extend(concurrency_fields(c));
    }
    if let Some(r) = &f.retries {
        fields.extend(retries_fields(r));
    }
    if let Some(m) = &f.memory {
        fields.extend(memory_fields(m));
    }
    if let Some(a) = &f.azure {
        fields.extend(azure_fields(a));
    }
    fields.extend(scale_fields(&f.scale));
    if let Some(r) = &f.rate_limit {
        fields.extend(rate_limit_fields(r));
    }
    if let Some(c) = &f.cpu {
        fields.extend(cpu_fields(c));
    }
    if let Some(l) = &f.ledger {
        fields.extend(ledger_fields(l));
    }
    if let Some(l) = &f.lines {
        fields.push(l.json());
    }
    if let Some(c) = &f.cost {
        fields.extend(cost_fields(c));
    }
    format!("{{{}}}", fields.join(","))
}

/// The Event Hubs emulator's produce and consume rates, per partition count.
fn eventhubs_fields(runs: &[Throughput]) -> Vec<String> {
    let mut fields = Vec::new();
    for r in runs {
        fields.push(format!(
            "\"eventhubs_produce_per_s_p{}\":{:.0}",
            r.partitions, r.produce_per_s
        ));
        fields.push(format!(
            "\"eventhubs_consume_per_s_p{}\":{:.0}",
            r.partitions, r.consume_per_s
        ));
    }
    fields
}

/// The guard against a bare consumer per partition count, then the last count's summary.
fn guard_fields(runs: &[GuardFigures]) -> Vec<String> {
    let mut fields = Vec::new();
    for g in runs {
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
    if let Some(g) = runs.last() {
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
    fields
}

/// The slow handler with one event in flight and with many.
fn concurrency_fields(c: &pipelines::Concurrency) -> Vec<String> {
    vec![
        format!("\"slow_handler_ms\":{}", c.delay.as_millis()),
        format!("\"slow_per_s_in_flight_1\":{:.1}", c.one_per_s),
        format!("\"slow_per_s_in_flight_{}\":{:.1}", c.wide, c.wide_per_s),
        format!("\"concurrency_speedup\":{:.2}", c.wide_per_s / c.one_per_s),
    ]
}

/// The retry path's scheduling latency and lateness.
fn retries_fields(r: &pipelines::RetryTiming) -> Vec<String> {
    vec![
        format!("\"retries_measured\":{}", r.retries),
        format!("\"schedule_latency_p50_ms\":{:.1}", r.schedule_ms.0),
        format!("\"schedule_latency_p99_ms\":{:.1}", r.schedule_ms.1),
        format!("\"lateness_p50_ms\":{:.1}", r.lateness_ms.0),
        format!("\"lateness_p99_ms\":{:.1}", r.lateness_ms.1),
    ]
}

/// Resident memory with no retries pending, a few and many, and the growth.
fn memory_fields(m: &memory::Memory) -> Vec<String> {
    let (lo, hi) = m.growth_range_mb();
    vec![
        format!("\"pending_retries\":{}", m.pending),
        format!("\"rss_mb_0_pending\":{:.1}", m.rss_idle_mb),
        format!("\"rss_mb_warm\":{:.1}", m.rss_warm_mb),
        format!("\"warm_pending_retries\":{}", m.warm_pending),
        format!("\"rss_mb_pending\":{:.1}", m.rss_pending_mb),
        format!(
            "\"rss_failure_path_fixed_mb\":{:.1}",
            m.rss_warm_mb - m.rss_idle_mb
        ),
        // Named after the issue's default size; `pending_retries` says what was measured.
        format!(
            "\"rss_growth_mb_100k_pending\":{:.1}",
            m.growth_per_pending_mb()
        ),
        format!("\"rss_growth_min_mb\":{lo:.1}"),
        format!("\"rss_growth_max_mb\":{hi:.1}"),
        format!("\"rss_growth_readings\":{}", m.growth_readings_mb.len()),
    ]
}

/// The `--profile azure` figures, after `"profile":"azure"`.
fn azure_fields(a: &azure::AzureFigures) -> Vec<String> {
    vec![
        "\"profile\":\"azure\"".into(),
        format!("\"azure_partitions\":{}", a.partitions),
        format!("\"azure_events\":{}", a.events),
        format!("\"azure_handler_ms\":{}", a.handler.as_millis()),
        format!("\"azure_max_in_flight\":{}", a.max_in_flight),
        format!("\"azure_retry_concurrency\":{}", a.retry_concurrency),
        format!(
            "\"azure_events_per_s_per_partition\":{:.0}",
            a.events_per_s_per_partition
        ),
        format!("\"azure_limit_per_s_per_partition\":{:.0}", a.limit_per_s()),
        format!("\"azure_limit_ratio\":{:.3}", a.limit_ratio()),
        format!(
            "\"azure_failing_events_per_s_per_partition\":{:.0}",
            a.failing_events_per_s_per_partition
        ),
        format!("\"azure_failure_ratio\":{:.3}", a.failure_ratio()),
        format!("\"azure_retries\":{}", a.retries),
        format!("\"azure_retry_drain_per_s\":{:.0}", a.retry_drain_per_s),
        format!("\"azure_retry_span_per_s\":{:.0}", a.retry_span_per_s),
        format!("\"azure_retry_drain_ratio\":{:.3}", a.retry_drain_ratio()),
        format!(
            "\"azure_batch_max\":{},\"azure_batch_max_in_flight\":{}",
            azure::BATCH_MAX,
            azure::BATCH_IN_FLIGHT
        ),
        format!(
            "\"azure_batch_events_per_s_per_partition\":{:.0}",
            a.batch_events_per_s_per_partition
        ),
        format!(
            "\"azure_batch_failing_events_per_s_per_partition\":{:.0}",
            a.batch_failing_events_per_s_per_partition
        ),
        format!(
            "\"azure_batch_failure_ratio\":{:.3}",
            a.batch_failure_ratio()
        ),
        azure_cpu_fields(a),
        format!(
            "\"azure_retry_lateness_p50_ms\":{:.0}",
            a.retry_lateness_ms.0
        ),
        format!(
            "\"azure_retry_lateness_p99_ms\":{:.0}",
            a.retry_lateness_ms.1
        ),
        format!("\"azure_retry_due_per_s\":{:.0}", a.retry_due_per_s),
        format!(
            "\"azure_retry_lateness_past_slot_p50_ms\":{:.0}",
            a.retry_lateness_past_slot_ms.0
        ),
        format!(
            "\"azure_retry_lateness_past_slot_p99_ms\":{:.0}",
            a.retry_lateness_past_slot_ms.1
        ),
    ]
}

/// CPU per event of the four first passes, hubguard's and the emulators' processes.
fn azure_cpu_fields(a: &azure::AzureFigures) -> String {
    let names = ["", "failing_", "batch_", "batch_failing_"];
    let mut v: Vec<String> = names
        .iter()
        .zip(&a.cpu)
        .map(|(n, c)| {
            format!(
                "\"azure_{n}cpu_us_per_event\":{:.1},\"azure_emulators_{n}cpu_us_per_event\":{:.1},\"azure_{n}machine_busy\":{:.2},\"azure_{n}partition_thread_busy\":{:.2}",
                c.hubguard_us, c.emulators_us, c.machine_busy, c.partition_thread_busy
            )
        })
        .collect();
    v.push(format!(
        "\"azure_batch_cpu_ratio\":{:.3}",
        a.batch_cpu_ratio()
    ));
    v.join(",")
}

/// Each scale run's duplicates, moves and longest unread time, by scenario and balancing.
fn scale_fields(runs: &[scale::ScaleRun]) -> Vec<String> {
    let mut fields = Vec::new();
    for r in runs {
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
    fields
}

/// The rate limit's cap phase, then its adaptive phase.
fn rate_limit_fields(r: &ratelimit::RateLimitFigures) -> Vec<String> {
    let (c, a) = (&r.cap, &r.adaptive);
    vec![
        format!("\"rate_limit_per_s\":{:.1}", c.limit),
        format!("\"rate_limit_max_per_s\":{}", c.max_per_s),
        format!(
            "\"rate_limit_max_ratio\":{:.3}",
            c.max_per_s as f64 / c.limit
        ),
        format!(
            "\"rate_limit_events_per_s\":{:.1}",
            c.events as f64 / c.seconds.max(1e-9)
        ),
        format!("\"adaptive_receiver_cap\":{}", a.cap.unwrap_or(0)),
        format!("\"adaptive_max_per_s\":{}", a.max_per_s),
        format!("\"adaptive_max_per_s_after_30s\":{}", a.max_per_s_after_30s),
        format!(
            "\"adaptive_converged_at_s\":{}",
            a.converged_at_s.map_or("null".into(), |s| s.to_string())
        ),
        format!(
            "\"adaptive_seconds_above_cap_after_30s\":{}",
            a.seconds_above_cap_after_30s
        ),
        format!("\"adaptive_throttled\":{}", a.throttled),
        format!("\"adaptive_dead_lettered\":{}", a.dead_lettered),
        format!("\"adaptive_breaker_opens\":{}", a.breaker_opens),
        format!("\"adaptive_decreases\":{}", a.decreases),
        format!(
            "\"adaptive_events_per_s\":{:.1}",
            a.events as f64 / a.seconds.max(1e-9)
        ),
    ]
}

/// CPU per event of hubguard and of a bare SDK consumer.
fn cpu_fields(c: &cpu::CpuFigures) -> Vec<String> {
    vec![
        format!("\"cpu_us_per_event_guard\":{:.1}", c.guard_us),
        format!("\"cpu_us_per_event_bare\":{:.1}", c.bare_us),
        format!("\"cpu_per_event_ratio\":{:.3}", c.ratio()),
    ]
}

/// The overdue sweep's listing: store calls, blobs listed, times and peak memory.
fn ledger_fields(l: &ledger::LedgerFigures) -> Vec<String> {
    let mb = |v: Option<f64>| v.map_or("null".to_string(), |v| format!("{v:.1}"));
    vec![
        format!("\"ledger_settled\":{}", l.settled),
        format!("\"ledger_pending\":{}", l.pending),
        format!("\"ledger_sweep_calls_settled\":{}", l.sweep_calls_settled),
        format!("\"ledger_sweep_calls_empty\":{}", l.sweep_calls_empty),
        format!("\"ledger_sweep_listed_settled\":{}", l.sweep_listed_settled),
        format!("\"retries_list_ms\":{:.1}", l.retries_list_ms),
        format!("\"retries_list_empty_ms\":{:.1}", l.retries_list_empty_ms),
        format!("\"ledger_sweep_peak_mb_settled\":{}", mb(l.sweep_peak_mb.0)),
        format!("\"ledger_sweep_peak_mb_empty\":{}", mb(l.sweep_peak_mb.1)),
        format!(
            "\"ledger_retention_peak_mb_settled\":{}",
            mb(l.retention_peak_mb.0)
        ),
        format!(
            "\"ledger_retention_peak_mb_empty\":{}",
            mb(l.retention_peak_mb.1)
        ),
    ]
}

/// Operations per event on each path, the lock's times, and the calls for no event.
fn cost_fields(c: &cost::CostFigures) -> Vec<String> {
    let mut fields = Vec::new();
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
    fields
}

#[cfg(test)]
mod tests {
    use super::json_line;

    /// Every figure set: the line's keys, their order and their number formatting.
    #[test]
    fn the_json_line_is_as_pinned() {
        let (args, f) = super::super::tests::sample();
        let expected = [
            r#""events":12345"#,
            r#""event_bytes":777"#,
            r#""eventhubs_produce_per_s_p1":45678"#,
            r#""eventhubs_consume_per_s_p1":23457"#,
            r#""eventhubs_produce_per_s_p4":98765"#,
            r#""eventhubs_consume_per_s_p4":87655"#,
            r#""bare_per_s_p1":20000"#,
            r#""guard_per_s_p1":19001"#,
            r#""guard_vs_bare_ratio_p1":0.950"#,
            r#""bare_per_s_p4":60001"#,
            r#""guard_per_s_p4":50000"#,
            r#""guard_vs_bare_ratio_p4":0.833"#,
            r#""guard_vs_bare_ratio":0.833"#,
            r#""checkpoint_writes_per_s":9.88"#,
            r#""checkpoint_writes_bound_per_s":11.11"#,
            r#""happy_path_ops_per_event":0.0007"#,
            r#""slow_handler_ms":20"#,
            r#""slow_per_s_in_flight_1":49.1"#,
            r#""slow_per_s_in_flight_32":1501.0"#,
            r#""concurrency_speedup":30.56"#,
            r#""retries_measured":500"#,
            r#""schedule_latency_p50_ms":3.5"#,
            r#""schedule_latency_p99_ms":12.3"#,
            r#""lateness_p50_ms":7.9"#,
            r#""lateness_p99_ms":45.7"#,
            r#""pending_retries":100000"#,
            r#""rss_mb_0_pending":21.2"#,
            r#""rss_mb_warm":35.7"#,
            r#""warm_pending_retries":1000"#,
            r#""rss_mb_pending":88.9"#,
            r#""rss_failure_path_fixed_mb":14.4"#,
            r#""rss_growth_mb_100k_pending":52.1"#,
            r#""rss_growth_min_mb":51.4"#,
            r#""rss_growth_max_mb":53.9"#,
            r#""rss_growth_readings":3"#,
            r#""profile":"azure""#,
            r#""azure_partitions":2"#,
            r#""azure_events":10000"#,
            r#""azure_handler_ms":50"#,
            r#""azure_max_in_flight":64"#,
            r#""azure_retry_concurrency":16"#,
            r#""azure_events_per_s_per_partition":1235"#,
            r#""azure_limit_per_s_per_partition":1280"#,
            r#""azure_limit_ratio":0.965"#,
            r#""azure_failing_events_per_s_per_partition":1111"#,
            r#""azure_failure_ratio":0.900"#,
            r#""azure_retries":10000"#,
            r#""azure_retry_drain_per_s":300"#,
            r#""azure_retry_span_per_s":251"#,
            r#""azure_retry_drain_ratio":0.938"#,
            r#""azure_batch_max":100"#,
            r#""azure_batch_max_in_flight":500"#,
            r#""azure_batch_events_per_s_per_partition":6789"#,
            r#""azure_batch_failing_events_per_s_per_partition":6543"#,
            r#""azure_batch_failure_ratio":0.964"#,
            r#""azure_cpu_us_per_event":400.0"#,
            r#""azure_emulators_cpu_us_per_event":900.0"#,
            r#""azure_machine_busy":0.50"#,
            r#""azure_partition_thread_busy":0.25"#,
            r#""azure_failing_cpu_us_per_event":450.0"#,
            r#""azure_emulators_failing_cpu_us_per_event":1000.0"#,
            r#""azure_failing_machine_busy":0.50"#,
            r#""azure_failing_partition_thread_busy":0.25"#,
            r#""azure_batch_cpu_us_per_event":200.0"#,
            r#""azure_emulators_batch_cpu_us_per_event":300.0"#,
            r#""azure_batch_machine_busy":0.50"#,
            r#""azure_batch_partition_thread_busy":0.25"#,
            r#""azure_batch_failing_cpu_us_per_event":260.0"#,
            r#""azure_emulators_batch_failing_cpu_us_per_event":420.0"#,
            r#""azure_batch_failing_machine_busy":0.50"#,
            r#""azure_batch_failing_partition_thread_busy":0.25"#,
            r#""azure_batch_cpu_ratio":0.500"#,
            r#""azure_retry_lateness_p50_ms":123"#,
            r#""azure_retry_lateness_p99_ms":568"#,
            r#""azure_retry_due_per_s":2346"#,
            r#""azure_retry_lateness_past_slot_p50_ms":12"#,
            r#""azure_retry_lateness_past_slot_p99_ms":46"#,
            r#""scale_scale_out_sdk_duplicates":37"#,
            r#""scale_scale_out_sdk_duplicate_pct":1.54"#,
            r#""scale_scale_out_sdk_moves":3"#,
            r#""scale_scale_out_sdk_max_unread_ms":5123"#,
            r#""scale_scale_out_handover_duplicates":0"#,
            r#""scale_scale_out_handover_duplicate_pct":0.00"#,
            r#""scale_scale_out_handover_moves":2"#,
            r#""scale_scale_out_handover_max_unread_ms":612"#,
            r#""scale_crash_handover_duplicates":11"#,
            r#""scale_crash_handover_duplicate_pct":0.46"#,
            r#""scale_crash_handover_moves":1"#,
            r#""scale_crash_handover_max_unread_ms":6001"#,
            r#""rate_limit_per_s":100.0"#,
            r#""rate_limit_max_per_s":103"#,
            r#""rate_limit_max_ratio":1.030"#,
            r#""rate_limit_events_per_s":95.7"#,
            r#""adaptive_receiver_cap":50"#,
            r#""adaptive_max_per_s":103"#,
            r#""adaptive_max_per_s_after_30s":52"#,
            r#""adaptive_converged_at_s":27"#,
            r#""adaptive_seconds_above_cap_after_30s":2"#,
            r#""adaptive_throttled":44"#,
            r#""adaptive_dead_lettered":0"#,
            r#""adaptive_breaker_opens":1"#,
            r#""adaptive_decreases":5"#,
            r#""adaptive_events_per_s":95.7"#,
            r#""cpu_us_per_event_guard":45.7"#,
            r#""cpu_us_per_event_bare":30.1"#,
            r#""cpu_per_event_ratio":1.516"#,
            r#""ledger_settled":200000"#,
            r#""ledger_pending":1000"#,
            r#""ledger_sweep_calls_settled":1041"#,
            r#""ledger_sweep_calls_empty":1001"#,
            r#""ledger_sweep_listed_settled":201000"#,
            r#""retries_list_ms":456.8"#,
            r#""retries_list_empty_ms":12.3"#,
            r#""ledger_sweep_peak_mb_settled":12.3"#,
            r#""ledger_sweep_peak_mb_empty":null"#,
            r#""ledger_retention_peak_mb_settled":null"#,
            r#""ledger_retention_peak_mb_empty":0.1"#,
            r#""lines_free_per_s_without_lines":1234.6"#,
            r#""lines_free_per_s_with_lines":1200.0"#,
            r#""lines_free_ratio":0.972"#,
            r#""lines_drain_per_s":77.8"#,
            r#""lines_drain_per_s_per_line":4.86"#,
            r#""lines_drain_s":5.14"#,
            r#""lines":16"#,
            r#""lines_length":25"#,
            r#""lines_drain_line_per_s":4.90"#,
            r#""lines_batch_max":100"#,
            r#""lines_batch_lines":4"#,
            r#""lines_batch_length":500"#,
            r#""lines_batch_drain_line_per_s":1234.5"#,
            r#""lines_batch_one_line_per_s":1500.0"#,
            r#""lines_batch_largest":100"#,
            r#""lines_batch_ratio":251.94"#,
            r#""ops_per_happy_path":{"total":3.857,"events":7,"blob_write":0,"blob_read":0.143,"blob_list":0.286,"blob_other":0,"servicebus_send":0.571,"servicebus_receive":0.714,"servicebus_complete":0,"servicebus_abandon":1,"servicebus_renew":1.143}"#,
            r#""ops_per_first_failure":{"total":12.857,"events":7,"blob_write":1,"blob_read":1.143,"blob_list":1.286,"blob_other":1,"servicebus_send":1.571,"servicebus_receive":1.714,"servicebus_complete":1,"servicebus_abandon":2,"servicebus_renew":2.143}"#,
            r#""ops_per_retry":{"total":17.357,"events":7,"blob_write":1.500,"blob_read":1.643,"blob_list":1.786,"blob_other":1.500,"servicebus_send":2.071,"servicebus_receive":2.214,"servicebus_complete":1.500,"servicebus_abandon":2.500,"servicebus_renew":2.643}"#,
            r#""ops_per_retry_rescheduled":{"total":21.857,"events":7,"blob_write":2,"blob_read":2.143,"blob_list":2.286,"blob_other":2,"servicebus_send":2.571,"servicebus_receive":2.714,"servicebus_complete":2,"servicebus_abandon":3,"servicebus_renew":3.143}"#,
            r#""ops_per_retry_renewed":{"total":33.107,"events":7,"blob_write":3.250,"blob_read":3.393,"blob_list":3.536,"blob_other":3.250,"servicebus_send":3.821,"servicebus_receive":3.964,"servicebus_complete":3.250,"servicebus_abandon":4.250,"servicebus_renew":4.393}"#,
            r#""ops_per_dead_letter":{"total":8.357,"events":7,"blob_write":0.500,"blob_read":0.643,"blob_list":0.786,"blob_other":0.500,"servicebus_send":1.071,"servicebus_receive":1.214,"servicebus_complete":0.500,"servicebus_abandon":1.500,"servicebus_renew":1.643}"#,
            r#""ops_per_dead_letter_exhausted":{"total":39.857,"events":7,"blob_write":4,"blob_read":4.143,"blob_list":4.286,"blob_other":4,"servicebus_send":4.571,"servicebus_receive":4.714,"servicebus_complete":4,"servicebus_abandon":5,"servicebus_renew":5.143}"#,
            r#""cost_lock_s":5"#,
            r#""cost_renewed_attempt_s":2.75"#,
            r#""cost_background":{"seconds":10.0,"blob_list":12,"servicebus_receive":34}"#,
        ];
        assert_eq!(json_line(&args, &f), format!("{{{}}}", expected.join(",")));
    }
}
