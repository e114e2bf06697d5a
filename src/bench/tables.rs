//! `hubguard bench` without `--json`: everything one run measured, as tables.

use std::fmt::{self, Write as _};

use super::{
    azure, cost, cpu, ledger, lines, memory, pipelines, ratelimit, scale, BenchArgs, Figures,
    GuardFigures, Throughput,
};

/// The cost table: operations per event on each path, by service and kind.
fn write_cost(out: &mut String, c: &cost::CostFigures) -> fmt::Result {
    writeln!(
        out,
        "Azure operations per event on each path (counted from the pipeline's calls; means)"
    )?;
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
    write!(out, "{:>34} {:>6} {:>6}", "", "blob", "sb")?;
    for k in cost::KINDS {
        write!(out, " {:>8}", short(k))?;
    }
    writeln!(out)?;
    for (_, label, ops) in c.paths() {
        write!(
            out,
            "{label:>34} {:>6.2} {:>6.2}",
            ops.blob(),
            ops.servicebus()
        )?;
        for k in cost::KINDS {
            write!(out, " {:>8.2}", ops.of(k))?;
        }
        writeln!(out)?;
    }
    writeln!(
        out,
        "(blob: write = Put Blob, read = Get Blob, list = List Blobs page, delete is free; sb: each is one billed operation. The renewed retry's attempt took {:.2} s on a {:.0} s lock.)",
        c.retry_long_attempt_s, c.lock_s
    )?;
    let background: Vec<String> = c
        .background
        .iter()
        .map(|(k, n)| format!("{} {n}", k.name()))
        .collect();
    writeln!(
        out,
        "Calls for no event in {:.1} s (sweeps, empty long polls; per replica, not per event): {}",
        c.seconds,
        background.join(", ")
    )?;
    writeln!(out)
}

/// The rate limit tables: a receiver that takes everything, then one that answers 429.
fn write_rate_limit(out: &mut String, r: &ratelimit::RateLimitFigures) -> fmt::Result {
    for (title, p) in [
        ("a receiver that takes everything", &r.cap),
        (
            "a receiver that answers 429 above its capacity",
            &r.adaptive,
        ),
    ] {
        writeln!(
            out,
            "Rate limit {:.0}/s for three replicas (6 partitions, max_in_flight 8 each), {title}",
            p.limit
        )?;
        writeln!(
            out,
            "{:>44} {}",
            "receiver capacity",
            p.cap.map_or("unlimited".into(), |c| format!("{c}/s"))
        )?;
        writeln!(
            out,
            "{:>44} {} in {:.1} s",
            "events delivered", p.events, p.seconds
        )?;
        writeln!(
            out,
            "{:>44} {} ({:.1} % of the limit)",
            "most requests in any 1 s window",
            p.max_per_s,
            100.0 * p.max_per_s as f64 / p.limit
        )?;
        if p.cap.is_some() {
            writeln!(out, "{:>44} {}", "… from 30 s on", p.max_per_s_after_30s)?;
            writeln!(
                out,
                "{:>44} {}",
                "whole seconds above capacity from 30 s on", p.seconds_above_cap_after_30s
            )?;
            writeln!(
                out,
                "{:>44} {}",
                "at or below capacity from second",
                p.converged_at_s.map_or("never".into(), |s| s.to_string())
            )?;
            writeln!(
                out,
                "{:>44} {} 429s, {} decreases, {} dead letters, {} breaker openings",
                "", p.throttled, p.decreases, p.dead_lettered, p.breaker_opens
            )?;
        }
        let seconds: Vec<String> = p.per_second.iter().map(|n| n.to_string()).collect();
        writeln!(out, "{:>44} {}", "requests per second", seconds.join(" "))?;
        writeln!(out)?;
    }
    Ok(())
}

/// Everything one run measured, as the tables `hubguard bench` prints.
pub(super) fn tables(args: &BenchArgs, f: &Figures) -> String {
    let mut out = String::new();
    write_tables(&mut out, args, f).expect("writing to a String cannot fail");
    out
}

/// Each scenario's table, for the scenarios that ran, in a fixed order.
fn write_tables(out: &mut String, args: &BenchArgs, f: &Figures) -> fmt::Result {
    if let Some(a) = &f.azure {
        write_azure(out, a)?;
    }
    if let Some(r) = &f.rate_limit {
        write_rate_limit(out, r)?;
    }
    if !f.eventhubs.is_empty() {
        write_eventhubs(out, args, &f.eventhubs)?;
    }
    if !f.guard.is_empty() {
        write_guard(out, &f.guard)?;
    }
    if let Some(c) = &f.concurrency {
        write_concurrency(out, c)?;
    }
    if let Some(r) = &f.retries {
        write_retries(out, r)?;
    }
    if let Some(c) = &f.cpu {
        write_cpu(out, c)?;
    }
    if let Some(l) = &f.ledger {
        write_ledger(out, l)?;
    }
    if let Some(c) = &f.cost {
        write_cost(out, c)?;
    }
    if let Some(l) = &f.lines {
        write_lines(out, l)?;
    }
    if let Some(m) = &f.memory {
        write_memory(out, m)?;
    }
    if !f.scale.is_empty() {
        write_scale(out, args, &f.scale)?;
    }
    Ok(())
}

/// The `--profile azure` table: first-pass and retry rates, each against its limit.
fn write_azure(out: &mut String, a: &azure::AzureFigures) -> fmt::Result {
    writeln!(
        out,
        "At Azure's latencies (blob 8ms:40ms, Service Bus 15ms:80ms, Event Hubs 5ms:20ms per round trip), a {} ms downstream, {} partitions, {} keyed events (997 keys), max_in_flight {}, retry.concurrency {}",
        a.handler.as_millis(),
        a.partitions,
        a.events,
        a.max_in_flight,
        a.retry_concurrency
    )?;
    let mut row = |label: &str, v: String| writeln!(out, "{label:>52} {v:>12}");
    row(
        "azure_events_per_s_per_partition",
        format!("{:.0}", a.events_per_s_per_partition),
    )?;
    row(
        "limit (max_in_flight / handler latency)",
        format!("{:.0}", a.limit_per_s()),
    )?;
    row("azure_limit_ratio", format!("{:.3}", a.limit_ratio()))?;
    row(
        "events/s per partition, 10 % failing once",
        format!("{:.0}", a.failing_events_per_s_per_partition),
    )?;
    row("azure_failure_ratio", format!("{:.3}", a.failure_ratio()))?;
    row(
        &format!(
            "retries drained per s while due and waiting ({} due in ~10 s)",
            a.retries
        ),
        format!("{:.0}", a.retry_drain_per_s),
    )?;
    row(
        "retries per s, first start to last return",
        format!("{:.0}", a.retry_span_per_s),
    )?;
    row(
        "limit (retry.concurrency / handler latency)",
        format!("{:.0}", a.retry_limit_per_s()),
    )?;
    row(
        "azure_retry_drain_ratio",
        format!("{:.3}", a.retry_drain_ratio()),
    )?;
    row(
        "azure_retry_lateness_p50_ms / p99_ms",
        format!(
            "{:.0} / {:.0}",
            a.retry_lateness_ms.0, a.retry_lateness_ms.1
        ),
    )?;
    row(
        "azure_retry_due_per_s (retries coming due per s)",
        format!("{:.0}", a.retry_due_per_s),
    )?;
    row(
        "azure_retry_lateness_past_slot_p50_ms / p99_ms",
        format!(
            "{:.0} / {:.0}",
            a.retry_lateness_past_slot_ms.0, a.retry_lateness_past_slot_ms.1
        ),
    )?;
    row(
        &format!(
            "batches of {} ({} in flight): azure_batch_events_per_s_per_partition",
            azure::BATCH_MAX,
            azure::BATCH_IN_FLIGHT
        ),
        format!("{:.0}", a.batch_events_per_s_per_partition),
    )?;
    row(
        "azure_batch_failure_ratio (10 % failing once)",
        format!("{:.3}", a.batch_failure_ratio()),
    )?;
    let names = [
        "alone",
        "alone, 10 % failing",
        "batches",
        "batches, 10 % failing",
    ];
    for (n, c) in names.iter().zip(&a.cpu) {
        row(
            &format!("CPU µs per event, {n}: hubguard / emulators"),
            format!("{:.0} / {:.0}", c.hubguard_us, c.emulators_us),
        )?;
        row(
            &format!("busy, {n}: cores / partition thread"),
            format!("{:.2} / {:.2}", c.machine_busy, c.partition_thread_busy),
        )?;
    }
    row(
        "azure_batch_cpu_ratio (hubguard, batches / alone)",
        format!("{:.3}", a.batch_cpu_ratio()),
    )?;
    writeln!(out)
}

/// The Event Hubs emulator's produce and consume rates, a row per partition count.
fn write_eventhubs(out: &mut String, args: &BenchArgs, runs: &[Throughput]) -> fmt::Result {
    writeln!(
        out,
        "Event Hubs emulator through azure_messaging_eventhubs 0.16 ({} events of {} B, batched sends)",
        args.events, args.size
    )?;
    writeln!(
        out,
        "{:>10} {:>16} {:>16}",
        "partitions", "produce ev/s", "consume ev/s"
    )?;
    for r in runs {
        writeln!(
            out,
            "{:>10} {:>16.0} {:>16.0}",
            r.partitions, r.produce_per_s, r.consume_per_s
        )?;
    }
    writeln!(out)
}

/// The guard's cost: a bare SDK consumer against hubguard, a row per partition count.
fn write_guard(out: &mut String, runs: &[GuardFigures]) -> fmt::Result {
    writeln!(
        out,
        "The guard's cost: bare SDK consumer vs hubguard with a no-op handler, same events, side by side"
    )?;
    writeln!(
        out,
        "(events/s from the first event to the last; checkpoint bound: per partition one write per checkpoint.min_interval, plus the first and the last)"
    )?;
    writeln!(
        out,
        "{:>10} {:>14} {:>14} {:>8} {:>12} {:>14} {:>12} {:>18}",
        "partitions",
        "bare ev/s",
        "hubguard ev/s",
        "ratio",
        "checkpoints",
        "ckpt writes/s",
        "ckpt bound/s",
        "SB+ledger ops/ev"
    )?;
    for g in runs {
        writeln!(
            out,
            "{:>10} {:>14.0} {:>14.0} {:>8.3} {:>12} {:>14.2} {:>12.1} {:>18.4}",
            g.partitions,
            g.bare_per_s,
            g.guard_per_s,
            g.guard_per_s / g.bare_per_s,
            g.checkpoint_writes,
            g.checkpoint_writes_per_s,
            g.checkpoint_writes_bound_per_s,
            g.happy_path_ops_per_event
        )?;
    }
    writeln!(out)
}

/// The slow handler's events/s with one event in flight and with many.
fn write_concurrency(out: &mut String, c: &pipelines::Concurrency) -> fmt::Result {
    writeln!(
        out,
        "A handler waiting {} ms per event, one partition",
        c.delay.as_millis()
    )?;
    writeln!(out, "{:>14} {:>12}", "max_in_flight", "events/s")?;
    writeln!(out, "{:>14} {:>12.1}", 1, c.one_per_s)?;
    writeln!(out, "{:>14} {:>12.1}", c.wide, c.wide_per_s)?;
    writeln!(out, "speed-up: {:.1}x", c.wide_per_s / c.one_per_s)?;
    writeln!(out)
}

/// The retry path's latencies (to Service Bus, and lateness), p50 and p99.
fn write_retries(out: &mut String, r: &pipelines::RetryTiming) -> fmt::Result {
    writeln!(
        out,
        "The retry path ({} events failing once, retried 1 s later, on the emulator)",
        r.retries
    )?;
    writeln!(out, "{:>44} {:>10} {:>10}", "", "p50 ms", "p99 ms")?;
    writeln!(
        out,
        "{:>44} {:>10.1} {:>10.1}",
        "failure -> Service Bus accepted the retry", r.schedule_ms.0, r.schedule_ms.1
    )?;
    writeln!(
        out,
        "{:>44} {:>10.1} {:>10.1}",
        "due time -> retry started (lateness)", r.lateness_ms.0, r.lateness_ms.1
    )?;
    writeln!(out)
}

/// CPU per event of hubguard against a bare SDK consumer.
fn write_cpu(out: &mut String, c: &cpu::CpuFigures) -> fmt::Result {
    writeln!(
        out,
        "CPU of the consuming process per event ({} events, {} partitions; emulators in a child process, latency {}; no-op handler)",
        c.events, c.partitions, c.latency
    )?;
    writeln!(
        out,
        "{:>24} {:>12} {:>12} {:>8}",
        "", "hubguard", "bare SDK", "ratio"
    )?;
    writeln!(
        out,
        "{:>24} {:>12.1} {:>12.1} {:>8.2}",
        "CPU µs per event",
        c.guard_us,
        c.bare_us,
        c.ratio()
    )?;
    writeln!(out)
}

/// The overdue sweep's listing over a ledger with settled records and over one without.
fn write_ledger(out: &mut String, l: &ledger::LedgerFigures) -> fmt::Result {
    writeln!(
        out,
        "The overdue sweep's listing (= /v1/retries, retries list, the gauges): {} waiting retries, with {} settled records and with none",
        l.pending, l.settled
    )?;
    writeln!(
        out,
        "(store calls billed as Azure does: one List Blobs call per 5,000 blobs, one per read)"
    )?;
    writeln!(out, "{:>24} {:>12} {:>12}", "", "settled", "empty")?;
    writeln!(
        out,
        "{:>24} {:>12} {:>12}",
        "store calls", l.sweep_calls_settled, l.sweep_calls_empty
    )?;
    writeln!(
        out,
        "{:>24} {:>12.1} {:>12.1}",
        "retries list ms", l.retries_list_ms, l.retries_list_empty_ms
    )?;
    writeln!(out, "{:>24} {:>12}", "blobs listed", l.sweep_listed_settled)?;
    let mb = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.1}"));
    writeln!(
        out,
        "{:>24} {:>12} {:>12}",
        "sweep peak +MB",
        mb(l.sweep_peak_mb.0),
        mb(l.sweep_peak_mb.1)
    )?;
    writeln!(
        out,
        "{:>24} {:>12} {:>12}",
        "retention peak +MB",
        mb(l.retention_peak_mb.0),
        mb(l.retention_peak_mb.1)
    )?;
    writeln!(
        out,
        "(peak resident memory gained during one pass, this process; Linux)"
    )?;
    writeln!(out)
}

/// Ordered retries: free keys' rate beside open lines, and released lines' drain.
fn write_lines(out: &mut String, l: &lines::LinesFigures) -> fmt::Result {
    writeln!(
        out,
        "Ordered retries at the azure latency profile: {} partitions, handler {} ms, {} lines of {} parked events, {} events of free keys (max_in_flight {})",
        l.partitions,
        l.handler.as_millis(),
        l.lines,
        l.line_length,
        l.free_events,
        crate::config::DEFAULT_MAX_IN_FLIGHT
    )?;
    writeln!(
        out,
        "{:>44} {:>10.1}",
        "free keys, events/s, no line open", l.free_per_s_without_lines
    )?;
    writeln!(
        out,
        "{:>44} {:>10.1}",
        "free keys, events/s, lines open and filling", l.free_per_s_with_lines
    )?;
    writeln!(out, "{:>44} {:>10.3}", "ratio", l.free_ratio())?;
    writeln!(
        out,
        "{:>44} {:>10.1} ({:.2} per line; {:.1} s for all)",
        "released lines drain, parked events/s",
        l.drain_per_s,
        l.drain_per_s_per_line(),
        l.drain_s
    )?;
    writeln!(
        out,
        "{:>44} {:>10.1}",
        "one by one, events/s per line", l.drain_line_per_s
    )?;
    if let (Some(b), Some(r)) = (&l.batched, l.batched_ratio()) {
        writeln!(
            out,
            "{:>44} {:>10.1} ({} lines of {} at once; largest batch {}; {:.1}× one by one)",
            format!("ordered batches of {}, events/s per line", b.batch_max),
            b.line_per_s,
            b.lines,
            b.line_length,
            b.largest_batch,
            r
        )?;
        writeln!(
            out,
            "{:>44} {:>10.1}",
            "ordered batches, one line alone, events/s", b.one_line_per_s
        )?;
    }
    writeln!(out)
}

/// Resident memory of `hubguard run` with no retries pending, a few, and many.
fn write_memory(out: &mut String, m: &memory::Memory) -> fmt::Result {
    writeln!(
        out,
        "Resident memory of `hubguard run` (a child process; emulators in this one)"
    )?;
    let mut row = |label: String, mb: f64| writeln!(out, "{label:>44} {mb:>10.1} MB");
    row("0 retries pending".into(), m.rss_idle_mb)?;
    row(
        format!("{} retries pending (warm-up)", m.warm_pending),
        m.rss_warm_mb,
    )?;
    row(format!("{} retries pending", m.pending), m.rss_pending_mb)?;
    row(
        "the failure path's fixed cost".into(),
        m.rss_warm_mb - m.rss_idle_mb,
    )?;
    let (lo, hi) = m.growth_range_mb();
    writeln!(
        out,
        "{:>44} {:>10.1} MB (median of {} readings a second apart; {lo:.1} to {hi:.1})",
        format!("growth for {} pending retries", m.pending),
        m.growth_per_pending_mb(),
        m.growth_readings_mb.len()
    )?;
    Ok(())
}

/// Replicas coming and going: duplicates, moves and longest unread time per scenario.
fn write_scale(out: &mut String, args: &BenchArgs, runs: &[scale::ScaleRun]) -> fmt::Result {
    writeln!(
        out,
        "Replicas coming and going on a backlog of 4 x {} events (max_in_flight {}, handler {} ms; update interval 0.5 s, ownership expiration 5 s)",
        args.scale_events, args.max_in_flight, args.scale_delay_ms
    )?;
    writeln!(
        out,
        "{:>16} {:>22} {:>11} {:>8} {:>6} {:>16}",
        "scenario", "balancing", "duplicates", "%", "moves", "max unread ms"
    )?;
    for r in runs {
        writeln!(
            out,
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
        )?;
    }
    writeln!(out)
}

#[cfg(test)]
mod tests {
    use super::tables;

    /// Every figure set: each table's title, columns, rows and number formatting.
    #[test]
    fn the_tables_are_as_pinned() {
        let (args, f) = super::super::tests::sample();
        let expected = r#"At Azure's latencies (blob 8ms:40ms, Service Bus 15ms:80ms, Event Hubs 5ms:20ms per round trip), a 50 ms downstream, 2 partitions, 10000 keyed events (997 keys), max_in_flight 64, retry.concurrency 16
                    azure_events_per_s_per_partition         1235
             limit (max_in_flight / handler latency)         1280
                                   azure_limit_ratio        0.965
           events/s per partition, 10 % failing once         1111
                                 azure_failure_ratio        0.900
retries drained per s while due and waiting (10000 due in ~10 s)          300
           retries per s, first start to last return          251
         limit (retry.concurrency / handler latency)          320
                             azure_retry_drain_ratio        0.938
                azure_retry_lateness_p50_ms / p99_ms    123 / 568
    azure_retry_due_per_s (retries coming due per s)         2346
      azure_retry_lateness_past_slot_p50_ms / p99_ms      12 / 46
batches of 100 (500 in flight): azure_batch_events_per_s_per_partition         6789
       azure_batch_failure_ratio (10 % failing once)        0.964
       CPU µs per event, alone: hubguard / emulators    400 / 900
               busy, alone: cores / partition thread  0.50 / 0.25
CPU µs per event, alone, 10 % failing: hubguard / emulators   450 / 1000
 busy, alone, 10 % failing: cores / partition thread  0.50 / 0.25
     CPU µs per event, batches: hubguard / emulators    200 / 300
             busy, batches: cores / partition thread  0.50 / 0.25
CPU µs per event, batches, 10 % failing: hubguard / emulators    260 / 420
busy, batches, 10 % failing: cores / partition thread  0.50 / 0.25
   azure_batch_cpu_ratio (hubguard, batches / alone)        0.500

Rate limit 100/s for three replicas (6 partitions, max_in_flight 8 each), a receiver that takes everything
                           receiver capacity unlimited
                            events delivered 1501 in 15.7 s
             most requests in any 1 s window 103 (103.0 % of the limit)
                         requests per second 98 103 101

Rate limit 100/s for three replicas (6 partitions, max_in_flight 8 each), a receiver that answers 429 above its capacity
                           receiver capacity 50/s
                            events delivered 1501 in 15.7 s
             most requests in any 1 s window 103 (103.0 % of the limit)
                              … from 30 s on 52
   whole seconds above capacity from 30 s on 2
            at or below capacity from second 27
                                             44 429s, 5 decreases, 0 dead letters, 1 breaker openings
                         requests per second 98 103 101

Event Hubs emulator through azure_messaging_eventhubs 0.16 (12345 events of 777 B, batched sends)
partitions     produce ev/s     consume ev/s
         1            45678            23457
         4            98765            87655

The guard's cost: bare SDK consumer vs hubguard with a no-op handler, same events, side by side
(events/s from the first event to the last; checkpoint bound: per partition one write per checkpoint.min_interval, plus the first and the last)
partitions      bare ev/s  hubguard ev/s    ratio  checkpoints  ckpt writes/s ckpt bound/s   SB+ledger ops/ev
         1          20000          19001    0.950           42           3.14          4.3             0.0123
         4          60001          50000    0.833           99           9.88         11.1             0.0007

A handler waiting 20 ms per event, one partition
 max_in_flight     events/s
             1         49.1
            32       1501.0
speed-up: 30.6x

The retry path (500 events failing once, retried 1 s later, on the emulator)
                                                 p50 ms     p99 ms
   failure -> Service Bus accepted the retry        3.5       12.3
        due time -> retry started (lateness)        7.9       45.7

CPU of the consuming process per event (12345 events, 4 partitions; emulators in a child process, latency none; no-op handler)
                             hubguard     bare SDK    ratio
        CPU µs per event         45.7         30.1     1.52

The overdue sweep's listing (= /v1/retries, retries list, the gauges): 1000 waiting retries, with 200000 settled records and with none
(store calls billed as Azure does: one List Blobs call per 5,000 blobs, one per read)
                              settled        empty
             store calls         1041         1001
         retries list ms        456.8         12.3
            blobs listed       201000
          sweep peak +MB         12.3          n/a
      retention peak +MB          n/a          0.1
(peak resident memory gained during one pass, this process; Linux)

Azure operations per event on each path (counted from the pipeline's calls; means)
                                     blob     sb    write     read     list   delete     send  receive complete  abandon    renew
    happy path (delivered at once)   0.43   3.43     0.00     0.14     0.29     0.00     0.57     0.71     0.00     1.00     1.14
   first failure (retry scheduled)   4.43   8.43     1.00     1.14     1.29     1.00     1.57     1.71     1.00     2.00     2.14
             a retry that delivers   6.43  10.93     1.50     1.64     1.79     1.50     2.07     2.21     1.50     2.50     2.64
          a retry that fails again   8.43  13.43     2.00     2.14     2.29     2.00     2.57     2.71     2.00     3.00     3.14
  a retry outlasting half the lock  13.43  19.68     3.25     3.39     3.54     3.25     3.82     3.96     3.25     4.25     4.39
     dead letter (permanent error)   2.43   5.93     0.50     0.64     0.79     0.50     1.07     1.21     0.50     1.50     1.64
      dead letter (attempts spent)  16.43  23.43     4.00     4.14     4.29     4.00     4.57     4.71     4.00     5.00     5.14
(blob: write = Put Blob, read = Get Blob, list = List Blobs page, delete is free; sb: each is one billed operation. The renewed retry's attempt took 2.75 s on a 5 s lock.)
Calls for no event in 10.0 s (sweeps, empty long polls; per replica, not per event): blob_list 12, servicebus_receive 34

Ordered retries at the azure latency profile: 4 partitions, handler 50 ms, 16 lines of 25 parked events, 12345 events of free keys (max_in_flight 64)
           free keys, events/s, no line open     1234.6
 free keys, events/s, lines open and filling     1200.0
                                       ratio      0.972
       released lines drain, parked events/s       77.8 (4.86 per line; 5.1 s for all)
               one by one, events/s per line        4.9
   ordered batches of 100, events/s per line     1234.5 (4 lines of 500 at once; largest batch 100; 251.9× one by one)
   ordered batches, one line alone, events/s     1500.0

Resident memory of `hubguard run` (a child process; emulators in this one)
                           0 retries pending       21.2 MB
              1000 retries pending (warm-up)       35.7 MB
                      100000 retries pending       88.9 MB
               the failure path's fixed cost       14.4 MB
           growth for 100000 pending retries       52.1 MB (median of 3 readings a second apart; 51.4 to 53.9)
Replicas coming and going on a backlog of 4 x 321 events (max_in_flight 17, handler 9 ms; update interval 0.5 s, ownership expiration 5 s)
        scenario              balancing  duplicates        %  moves    max unread ms
       scale out   SDK alone (stealing)          37     1.54      3             5123
       scale out      hubguard handover           0     0.00      2              612
           crash      hubguard handover          11     0.46      1             6001

"#;
        assert_eq!(tables(&args, &f), expected);
    }
}
