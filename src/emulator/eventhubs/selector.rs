//! The receiver's start position: the `apache.org:selector-filter:string` expression that
//! every Event Hubs SDK sends, e.g. `amqp.annotation.x-opt-offset > '-1'` (Python spacing) or
//! `amqp.annotation.x-opt-sequence-number >='42'` (Rust spacing).

/// Where a receiver starts reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartPosition {
    /// From the first retained event (`x-opt-offset > '-1'`, or no filter value at all).
    Earliest,
    /// Only events enqueued after the link attached (`x-opt-offset > '@latest'`).
    Latest,
    /// After (or at, when inclusive) the event with this offset.
    Offset {
        /// The offset in the filter.
        offset: i64,
        /// `>=` rather than `>`.
        inclusive: bool,
    },
    /// After (or at) this sequence number.
    SequenceNumber {
        /// The sequence number in the filter.
        sequence_number: i64,
        /// `>=` rather than `>`.
        inclusive: bool,
    },
    /// Events enqueued after (or at) this time, in milliseconds since the Unix epoch.
    EnqueuedTime {
        /// The time in the filter.
        millis: i64,
        /// `>=` rather than `>`.
        inclusive: bool,
    },
}

/// A selector the emulator cannot interpret (the service answers `argument-error`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported selector filter: {0}")]
pub struct SelectorError(pub String);

/// Parses `amqp.annotation.<x-opt-…> (>|>=) '<value>'`, tolerating any spacing.
pub fn parse(expr: &str) -> Result<StartPosition, SelectorError> {
    let bad = || SelectorError(expr.to_string());
    let rest = expr
        .trim()
        .strip_prefix("amqp.annotation.")
        .ok_or_else(bad)?;
    let name_end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .ok_or_else(bad)?;
    let (name, rest) = rest.split_at(name_end);
    let rest = rest.trim_start();
    let (inclusive, rest) = if let Some(r) = rest.strip_prefix(">=") {
        (true, r)
    } else if let Some(r) = rest.strip_prefix('>') {
        (false, r)
    } else {
        return Err(bad());
    };
    let rest = rest.trim();
    let value = rest
        .strip_prefix('\'')
        .and_then(|r| r.strip_suffix('\''))
        .ok_or_else(bad)?;
    let number = || value.trim().parse::<i64>().map_err(|_| bad());
    match name {
        "x-opt-offset" => match value {
            "-1" => Ok(StartPosition::Earliest),
            "@latest" => Ok(StartPosition::Latest),
            _ => Ok(StartPosition::Offset {
                offset: number()?,
                inclusive,
            }),
        },
        "x-opt-sequence-number" => Ok(StartPosition::SequenceNumber {
            sequence_number: number()?,
            inclusive,
        }),
        "x-opt-enqueued-time" => Ok(StartPosition::EnqueuedTime {
            millis: number()?,
            inclusive,
        }),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_every_form_both_sdks_send() {
        assert_eq!(
            parse("amqp.annotation.x-opt-offset >'-1'"),
            Ok(StartPosition::Earliest)
        );
        assert_eq!(
            parse("amqp.annotation.x-opt-offset > '-1'"),
            Ok(StartPosition::Earliest)
        );
        assert_eq!(
            parse("amqp.annotation.x-opt-offset > '@latest'"),
            Ok(StartPosition::Latest)
        );
        assert_eq!(
            parse("amqp.annotation.x-opt-offset >='1234'"),
            Ok(StartPosition::Offset {
                offset: 1234,
                inclusive: true
            })
        );
        assert_eq!(
            parse("amqp.annotation.x-opt-sequence-number >'7'"),
            Ok(StartPosition::SequenceNumber {
                sequence_number: 7,
                inclusive: false
            })
        );
        assert_eq!(
            parse("amqp.annotation.x-opt-enqueued-time >= '1700000000000'"),
            Ok(StartPosition::EnqueuedTime {
                millis: 1_700_000_000_000,
                inclusive: true
            })
        );
    }

    #[test]
    fn refuses_what_it_cannot_serve() {
        assert!(parse("amqp.annotation.x-opt-offset > 'None'").is_err());
        assert!(parse("amqp.annotation.x-opt-other > '1'").is_err());
        assert!(parse("amqp.annotation.x-opt-offset < '1'").is_err());
        assert!(parse("x-opt-offset > '1'").is_err());
        assert!(parse("amqp.annotation.x-opt-offset > 1").is_err());
    }

    proptest! {
        #[test]
        fn any_sequence_number_and_spacing_round_trips(n in any::<i64>(), incl in any::<bool>(), s1 in 0usize..3, s2 in 0usize..3) {
            let op = if incl { ">=" } else { ">" };
            let expr = format!("amqp.annotation.x-opt-sequence-number{}{op}{}'{n}'", " ".repeat(s1), " ".repeat(s2));
            prop_assert_eq!(parse(&expr), Ok(StartPosition::SequenceNumber { sequence_number: n, inclusive: incl }));
        }
    }
}
