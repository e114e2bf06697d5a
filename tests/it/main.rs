//! hubguard's integration tests: the real Azure SDK crates over loopback against the
//! in-process emulators. One binary, so linking happens once.

mod alerts;
mod architecture;
mod bad_state;
mod blob;
mod cli;
mod common;
mod concurrency;
mod dashboards;
mod demo;
mod deployments;
mod eventhubs_amqp;
mod eventhubs_processor;
mod eventhubs_sdk;
mod interop;
mod ledger_scale;
mod limits;
mod operable;
mod otlp;
mod outage;
mod owner_ids;
mod pipeline;
mod pipeline_support;
mod refusals;
mod run_command;
mod secrets;
mod servicebus;
mod servicebus_auth;
mod telemetry;
mod test_log;
mod webhook;
mod webhook_conventions;
