//! `hubguard bench` without `--json`: everything one run measured, as tables.

use super::{cost, ratelimit, BenchArgs, Figures};

/// The cost table: operations per event on each path, by service and kind.
fn print_cost(c: &cost::CostFigures) {
    println!("Azure operations per event on each path (counted from the pipeline's calls; means)");
    let short = |k: cost::Kind| match k {
        cost::Kind::BlobWrite => "write",
        cost::Kind::BlobRead => "read",
        cost::Kind::BlobList => "list",
        cost::Kind::BlobOther => "delete",
        cost::Kind::SbSend => "send",
        cost::Kind::SbReceive => "receive",
        cost::Kind::SbComplete => "complete",
        cost::Kind::SbAbandon => "abandon",
        cost::Kind::SbRenew => "renew",
    };
    print!("{:>34} {:>6} {:>6}", "", "blob", "sb");
    for k in cost::KINDS {
        print!(" {:>8}", short(k));
    }
    println!();
    for (_, label, ops) in c.paths() {
        print!("{label:>34} {:>6.2} {:>6.2}", ops.blob(), ops.servicebus());
        for k in cost::KINDS {
            print!(" {:>8.2}", ops.of(k));
        }
        println!();
    }
    println!(
        "(blob: write = Put Blob, read = Get Blob, list = List Blobs page, delete is free; sb: each is one billed operation. The renewed retry's attempt took {:.2} s on a {:.0} s lock.)",
        c.retry_long_attempt_s, c.lock_s
    );
    let background: Vec<String> = c
        .background
        .iter()
        .map(|(k, n)| format!("{} {n}", k.name()))
        .collect();
    println!(
        "Calls for no event in {:.1} s (sweeps, empty long polls; per replica, not per event): {}",
        c.seconds,
        background.join(", ")
    );
    println!();
}

fn print_rate_limit(r: &ratelimit::RateLimitFigures) {
    for (title, p) in [
        ("a receiver that takes everything", &r.cap),
        (
            "a receiver that answers 429 above its capacity",
            &r.adaptive,
        ),
    ] {
        println!(
            "Rate limit {:.0}/s for three replicas (6 partitions, max_in_flight 8 each), {title}",
            p.limit
        );
        println!(
            "{:>44} {}",
            "receiver capacity",
            p.cap.map_or("unlimited".into(), |c| format!("{c}/s"))
        );
        println!(
            "{:>44} {} in {:.1} s",
            "events delivered", p.events, p.seconds
        );
        println!(
            "{:>44} {} ({:.1} % of the limit)",
            "most requests in any 1 s window",
            p.max_per_s,
            100.0 * p.max_per_s as f64 / p.limit
        );
        if p.cap.is_some() {
            println!("{:>44} {}", "… from 30 s on", p.max_per_s_after_30s);
            println!(
                "{:>44} {}",
                "whole seconds above capacity from 30 s on", p.seconds_above_cap_after_30s
            );
            println!(
                "{:>44} {}",
                "at or below capacity from second",
                p.converged_at_s.map_or("never".into(), |s| s.to_string())
            );
            println!(
                "{:>44} {} 429s, {} decreases, {} dead letters, {} breaker openings",
                "", p.throttled, p.decreases, p.dead_lettered, p.breaker_opens
            );
        }
        let seconds: Vec<String> = p.per_second.iter().map(|n| n.to_string()).collect();
        println!("{:>44} {}", "requests per second", seconds.join(" "));
        println!();
    }
}

pub(super) fn print_tables(args: &BenchArgs, f: &Figures) {
    if let Some(a) = &f.azure {
        println!(
            "At Azure's latencies (blob 8ms:40ms, Service Bus 15ms:80ms, Event Hubs 5ms:20ms per round trip), a {} ms downstream, {} partitions, {} keyed events (997 keys), max_in_flight {}, retry.concurrency {}",
            a.handler.as_millis(),
            a.partitions,
            a.events,
            a.max_in_flight,
            a.retry_concurrency
        );
        let row = |label: &str, v: String| println!("{label:>52} {v:>12}");
        row(
            "azure_events_per_s_per_partition",
            format!("{:.0}", a.events_per_s_per_partition),
        );
        row(
            "limit (max_in_flight / handler latency)",
            format!("{:.0}", a.limit_per_s()),
        );
        row("azure_limit_ratio", format!("{:.3}", a.limit_ratio()));
        row(
            "events/s per partition, 10 % failing once",
            format!("{:.0}", a.failing_events_per_s_per_partition),
        );
        row("azure_failure_ratio", format!("{:.3}", a.failure_ratio()));
        row(
            &format!(
                "retries drained per s while due and waiting ({} due in ~10 s)",
                a.retries
            ),
            format!("{:.0}", a.retry_drain_per_s),
        );
        row(
            "retries per s, first start to last return",
            format!("{:.0}", a.retry_span_per_s),
        );
        row(
            "limit (retry.concurrency / handler latency)",
            format!("{:.0}", a.retry_limit_per_s()),
        );
        row(
            "azure_retry_drain_ratio",
            format!("{:.3}", a.retry_drain_ratio()),
        );
        row(
            "azure_retry_lateness_p50_ms / p99_ms",
            format!(
                "{:.0} / {:.0}",
                a.retry_lateness_ms.0, a.retry_lateness_ms.1
            ),
        );
        println!();
    }
    if let Some(r) = &f.rate_limit {
        print_rate_limit(r);
    }
    if !f.eventhubs.is_empty() {
        println!("Event Hubs emulator through azure_messaging_eventhubs 0.16 ({} events of {} B, batched sends)", args.events, args.size);
        println!(
            "{:>10} {:>16} {:>16}",
            "partitions", "produce ev/s", "consume ev/s"
        );
        for r in &f.eventhubs {
            println!(
                "{:>10} {:>16.0} {:>16.0}",
                r.partitions, r.produce_per_s, r.consume_per_s
            );
        }
        println!();
    }
    if !f.guard.is_empty() {
        println!("The guard's cost: bare SDK consumer vs hubguard with a no-op handler, same events, side by side");
        println!("(events/s from the first event to the last; checkpoint bound: per partition one write per checkpoint.min_interval, plus the first and the last)");
        println!(
            "{:>10} {:>14} {:>14} {:>8} {:>12} {:>14} {:>12} {:>18}",
            "partitions",
            "bare ev/s",
            "hubguard ev/s",
            "ratio",
            "checkpoints",
            "ckpt writes/s",
            "ckpt bound/s",
            "SB+ledger ops/ev"
        );
        for g in &f.guard {
            println!(
                "{:>10} {:>14.0} {:>14.0} {:>8.3} {:>12} {:>14.2} {:>12.1} {:>18.4}",
                g.partitions,
                g.bare_per_s,
                g.guard_per_s,
                g.guard_per_s / g.bare_per_s,
                g.checkpoint_writes,
                g.checkpoint_writes_per_s,
                g.checkpoint_writes_bound_per_s,
                g.happy_path_ops_per_event
            );
        }
        println!();
    }
    if let Some(c) = &f.concurrency {
        println!(
            "A handler waiting {} ms per event, one partition",
            c.delay.as_millis()
        );
        println!("{:>14} {:>12}", "max_in_flight", "events/s");
        println!("{:>14} {:>12.1}", 1, c.one_per_s);
        println!("{:>14} {:>12.1}", c.wide, c.wide_per_s);
        println!("speed-up: {:.1}x", c.wide_per_s / c.one_per_s);
        println!();
    }
    if let Some(r) = &f.retries {
        println!(
            "The retry path ({} events failing once, retried 1 s later, on the emulator)",
            r.retries
        );
        println!("{:>44} {:>10} {:>10}", "", "p50 ms", "p99 ms");
        println!(
            "{:>44} {:>10.1} {:>10.1}",
            "failure -> Service Bus accepted the retry", r.schedule_ms.0, r.schedule_ms.1
        );
        println!(
            "{:>44} {:>10.1} {:>10.1}",
            "due time -> retry started (lateness)", r.lateness_ms.0, r.lateness_ms.1
        );
        println!();
    }
    if let Some(c) = &f.cpu {
        println!(
            "CPU of the consuming process per event ({} events, {} partitions; emulators in a child process, latency {}; no-op handler)",
            c.events, c.partitions, c.latency
        );
        println!(
            "{:>24} {:>12} {:>12} {:>8}",
            "", "hubguard", "bare SDK", "ratio"
        );
        println!(
            "{:>24} {:>12.1} {:>12.1} {:>8.2}",
            "CPU µs per event",
            c.guard_us,
            c.bare_us,
            c.ratio()
        );
        println!();
    }
    if let Some(l) = &f.ledger {
        println!(
            "The overdue sweep's listing (= /v1/retries, retries list, the gauges): {} waiting retries, with {} settled records and with none",
            l.pending, l.settled
        );
        println!(
            "(store calls billed as Azure does: one List Blobs call per 5,000 blobs, one per read)"
        );
        println!("{:>24} {:>12} {:>12}", "", "settled", "empty");
        println!(
            "{:>24} {:>12} {:>12}",
            "store calls", l.sweep_calls_settled, l.sweep_calls_empty
        );
        println!(
            "{:>24} {:>12.1} {:>12.1}",
            "retries list ms", l.retries_list_ms, l.retries_list_empty_ms
        );
        println!("{:>24} {:>12}", "blobs listed", l.sweep_listed_settled);
        let mb = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.1}"));
        println!(
            "{:>24} {:>12} {:>12}",
            "sweep peak +MB",
            mb(l.sweep_peak_mb.0),
            mb(l.sweep_peak_mb.1)
        );
        println!(
            "{:>24} {:>12} {:>12}",
            "retention peak +MB",
            mb(l.retention_peak_mb.0),
            mb(l.retention_peak_mb.1)
        );
        println!("(peak resident memory gained during one pass, this process; Linux)");
        println!();
    }
    if let Some(c) = &f.cost {
        print_cost(c);
    }
    if let Some(l) = &f.lines {
        println!(
            "Ordered retries at the azure latency profile: {} partitions, handler {} ms, {} lines of {} parked events, {} events of free keys (max_in_flight {})",
            l.partitions,
            l.handler.as_millis(),
            l.lines,
            l.line_length,
            l.free_events,
            crate::config::DEFAULT_MAX_IN_FLIGHT
        );
        println!(
            "{:>44} {:>10.1}",
            "free keys, events/s, no line open", l.free_per_s_without_lines
        );
        println!(
            "{:>44} {:>10.1}",
            "free keys, events/s, lines open and filling", l.free_per_s_with_lines
        );
        println!("{:>44} {:>10.3}", "ratio", l.free_ratio());
        println!(
            "{:>44} {:>10.1} ({:.2} per line; {:.1} s for all)",
            "released lines drain, parked events/s",
            l.drain_per_s,
            l.drain_per_s_per_line(),
            l.drain_s
        );
        println!();
    }
    if let Some(m) = &f.memory {
        println!("Resident memory of `hubguard run` (a child process; emulators in this one)");
        let row = |label: String, mb: f64| println!("{label:>44} {mb:>10.1} MB");
        row("0 retries pending".into(), m.rss_idle_mb);
        row(
            format!("{} retries pending (warm-up)", m.warm_pending),
            m.rss_warm_mb,
        );
        row(format!("{} retries pending", m.pending), m.rss_pending_mb);
        row(
            "the failure path's fixed cost".into(),
            m.rss_warm_mb - m.rss_idle_mb,
        );
        let (lo, hi) = m.growth_range_mb();
        println!(
            "{:>44} {:>10.1} MB (median of {} readings a second apart; {lo:.1} to {hi:.1})",
            format!("growth for {} pending retries", m.pending),
            m.growth_per_pending_mb(),
            m.growth_readings_mb.len()
        );
    }
    if !f.scale.is_empty() {
        println!(
            "Replicas coming and going on a backlog of 4 x {} events (max_in_flight {}, handler {} ms; update interval 0.5 s, ownership expiration 5 s)",
            args.scale_events, args.max_in_flight, args.scale_delay_ms
        );
        println!(
            "{:>16} {:>22} {:>11} {:>8} {:>6} {:>16}",
            "scenario", "balancing", "duplicates", "%", "moves", "max unread ms"
        );
        for r in &f.scale {
            println!(
                "{:>16} {:>22} {:>11} {:>8.2} {:>6} {:>16}",
                r.scenario,
                if r.handover {
                    "hubguard handover"
                } else {
                    "SDK alone (stealing)"
                },
                r.duplicates,
                r.duplicate_pct(),
                r.moves,
                r.max_unread_ms
            );
        }
        println!();
    }
}
