//! Every outcome an attempt can have, as one closed enum, and the policy that maps each to what
//! the executor does — README's "What each error does" table as code.
//!
//! The model is Envoy's retry policy (which outcomes are retried is a declared table, not code
//! paths) and linkerd2-proxy's response classifiers (one classifier turns a response into a small
//! enum; everything downstream reads the enum, never the raw response again). The executor only
//! *applies* the [`Action`] that [`action`] returns; `upstream::classify` only *classifies*.
//!
//! Each variant serialises to the string the audit trail, `/status` and the 503 body have always
//! used (`connect_error`, `skipped_cooldown`, …): those strings are a contract with users'
//! queries and dashboards, so [`Outcome::as_str`] is the one place they are spelt.

use std::fmt;
use std::time::Duration;

use serde::{Serialize, Serializer};

/// What happened to one candidate endpoint within one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Served (a 2xx, or a stream that produced its first content chunk).
    Ok,

    // ── An upstream call that failed, as `upstream::classify` saw it ──
    /// TCP connect failed or was refused (or no discovered task to connect to).
    Connect,
    /// The connection broke before a full response (reset, closed early).
    Connection,
    /// No complete response within `timeouts.total` (or cut by `request_timeout`).
    Timeout,
    /// A stream produced no content within `timeouts.first_token`.
    FirstTokenTimeout,
    /// 5xx.
    Server,
    /// 429.
    RateLimited,
    /// 410.
    Gone,
    /// 401/403.
    Auth,
    /// 400-class (or a 500 of some servers) with a context-length message.
    ContextLength,
    /// 404 for the *upstream's* model: the endpoint is misconfigured or the model not pulled.
    ModelMissing,
    /// Any other 4xx: the client's fault; returned unchanged.
    Client,
    /// An error event inside a 200 stream (before the commit: fail over; after: recorded).
    InBand,
    /// A 2xx body that is not what the protocol promises.
    Malformed,
    /// The request cannot be expressed in this endpoint's protocol (e.g. a remote image URL for
    /// Ollama): skipped, not the endpoint's fault.
    Unsupported,
    /// The endpoint answered 404 (or 405) for `/responses`: it speaks only chat. Marked so, and
    /// the request goes on at once by translation to chat, on the same endpoint.
    ResponsesUnsupported,
    /// The endpoint no longer knows the `previous_response_id` it produced (its 404 says so):
    /// not its fault; the conversation is replayed elsewhere from the gateway's history, if kept.
    PreviousResponseLost,

    // ── Not called: the router or the context check ruled the endpoint out ──
    SkippedRetired,
    SkippedAuthFailed,
    SkippedCooldown,
    SkippedCapability,
    SkippedUnhealthy,
    /// The endpoint's (or every key's) last `x-ratelimit-remaining-*` says this request would
    /// get a 429: skipped until its budget is predicted to cover it.
    SkippedRatelimitPredicted,
    /// The prompt does not fit the endpoint's (known) context window.
    ContextSkip,
    /// The request's client key may not use this endpoint (its `models` allow-list covers
    /// neither it nor a route whose chain holds it): never called, for the request nor its
    /// hedges and continuations.
    SkippedNotAllowed,
    /// The request continues a conversation (`previous_response_id`) that lives on another
    /// endpoint, and the gateway kept no history to replay it here: never called.
    SkippedPinned,

    // ── A committed stream that ended badly (the client already has bytes) ──
    StreamBroken,
    StreamStalled,
    StreamTruncated,
    StreamTimeout,

    // ── Hedging ──
    /// A hedged race's loser: cancelled (its connection closed) when the other attempt won.
    HedgeCancelled,

    // ── The request itself was cut off ──
    /// The client went away before the response (or the stream) ended.
    ClientClosed,
    /// `shutdown_grace` passed with the request still running.
    Shutdown,
    /// A bug panicked inside the handler.
    InternalPanic,

    // ── The gateway's own trouble ──
    /// The connection could not be made because this process was out of file descriptors
    /// (`EMFILE`/`ENFILE`): says nothing of the endpoint, so nothing is counted; fail over (an
    /// endpoint with an idle pooled connection needs no new descriptor).
    OutOfFiles,
}

impl Outcome {
    /// Every variant, for tests that walk the whole table.
    pub const ALL: [Outcome; 35] = [
        Outcome::Ok,
        Outcome::Connect,
        Outcome::Connection,
        Outcome::Timeout,
        Outcome::FirstTokenTimeout,
        Outcome::Server,
        Outcome::RateLimited,
        Outcome::Gone,
        Outcome::Auth,
        Outcome::ContextLength,
        Outcome::ModelMissing,
        Outcome::Client,
        Outcome::InBand,
        Outcome::Malformed,
        Outcome::Unsupported,
        Outcome::ResponsesUnsupported,
        Outcome::PreviousResponseLost,
        Outcome::SkippedRetired,
        Outcome::SkippedAuthFailed,
        Outcome::SkippedCooldown,
        Outcome::SkippedCapability,
        Outcome::SkippedUnhealthy,
        Outcome::SkippedRatelimitPredicted,
        Outcome::ContextSkip,
        Outcome::SkippedNotAllowed,
        Outcome::SkippedPinned,
        Outcome::StreamBroken,
        Outcome::StreamStalled,
        Outcome::StreamTruncated,
        Outcome::StreamTimeout,
        Outcome::HedgeCancelled,
        Outcome::ClientClosed,
        Outcome::Shutdown,
        Outcome::InternalPanic,
        Outcome::OutOfFiles,
    ];

    /// The contract string (audit trail `attempts.class`, `/status`, the 503 body).
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Connect => "connect_error",
            Outcome::Connection => "connection_error",
            Outcome::Timeout => "timeout",
            Outcome::FirstTokenTimeout => "first_token_timeout",
            Outcome::Server => "server_error",
            Outcome::RateLimited => "rate_limited",
            Outcome::Gone => "gone",
            Outcome::Auth => "auth_failed",
            Outcome::ContextLength => "context_length",
            Outcome::ModelMissing => "model_missing",
            Outcome::Client => "client_error",
            Outcome::InBand => "stream_error_event",
            Outcome::Malformed => "malformed_response",
            Outcome::Unsupported => "unsupported_request",
            Outcome::ResponsesUnsupported => "responses_unsupported",
            Outcome::PreviousResponseLost => "previous_response_lost",
            Outcome::SkippedRetired => "skipped_retired",
            Outcome::SkippedAuthFailed => "skipped_auth_failed",
            Outcome::SkippedCooldown => "skipped_cooldown",
            Outcome::SkippedCapability => "skipped_capability",
            Outcome::SkippedUnhealthy => "skipped_unhealthy",
            Outcome::SkippedRatelimitPredicted => "skipped_ratelimit_predicted",
            Outcome::HedgeCancelled => "hedge_cancelled",
            Outcome::ContextSkip => "context_skip",
            Outcome::SkippedNotAllowed => "skipped_not_allowed",
            Outcome::SkippedPinned => "skipped_pinned",
            Outcome::StreamBroken => "stream_broken",
            Outcome::StreamStalled => "stream_stalled",
            Outcome::StreamTruncated => "stream_truncated",
            Outcome::StreamTimeout => "stream_timeout",
            Outcome::ClientClosed => "client_closed",
            Outcome::Shutdown => "shutdown",
            Outcome::InternalPanic => "internal_panic",
            Outcome::OutOfFiles => "gateway_out_of_files",
        }
    }

    /// The endpoint was not called: a skip by the router or by the context check.
    pub const fn is_skip(self) -> bool {
        matches!(
            self,
            Outcome::SkippedRetired
                | Outcome::SkippedAuthFailed
                | Outcome::SkippedCooldown
                | Outcome::SkippedCapability
                | Outcome::SkippedUnhealthy
                | Outcome::SkippedRatelimitPredicted
                | Outcome::ContextSkip
                | Outcome::SkippedNotAllowed
                | Outcome::SkippedPinned
        )
    }

    /// The endpoint ruled itself out on size: refused the prompt, or could not hold it.
    pub const fn is_context(self) -> bool {
        matches!(self, Outcome::ContextLength | Outcome::ContextSkip)
    }

    /// Whether the failure counts against the endpoint's success rate.
    pub const fn counts_against_endpoint(self) -> bool {
        !matches!(
            self,
            Outcome::Ok
                | Outcome::Client
                | Outcome::ContextLength
                | Outcome::RateLimited
                | Outcome::Unsupported
                | Outcome::ResponsesUnsupported
                | Outcome::PreviousResponseLost
                | Outcome::HedgeCancelled
                | Outcome::ClientClosed
                | Outcome::Shutdown
                | Outcome::InternalPanic
                | Outcome::OutOfFiles
        ) && !self.is_skip()
    }

    /// Whether a bounded retry on the same endpoint may help (`retries:`).
    pub const fn retryable_same_endpoint(self) -> bool {
        matches!(
            self,
            Outcome::Connect
                | Outcome::Connection
                | Outcome::Timeout
                | Outcome::FirstTokenTimeout
                | Outcome::Server
                | Outcome::InBand
                | Outcome::Malformed
        )
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Outcome {
    type Err = ();
    /// The contract string back to its outcome (reading the audit trail).
    fn from_str(s: &str) -> Result<Self, ()> {
        Outcome::ALL.into_iter().find(|o| o.as_str() == s).ok_or(())
    }
}

impl Serialize for Outcome {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// What the executor does with one attempt's outcome. The executor applies it and nothing else:
/// no outcome is inspected anywhere but in [`action`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Answer the client with this response.
    Serve,
    /// The client's own error: return the upstream's response unchanged, no failover.
    ReturnToClient,
    /// Record a failure against the endpoint; try it again (after full-jitter backoff) when it
    /// has `retries` left, else fail over.
    Fail { retry: bool },
    /// No penalty, but no traffic to the endpoint for this long; fail over at once (and
    /// `max_wait` may wait for it to come back within this request).
    CoolDown(Duration),
    /// Out of rotation until the config changes it or an operator clears it; fail over.
    Retire,
    /// The key was refused: reject it and try the endpoint's next key at once (with none left the
    /// endpoint is `auth_failed`). Without a key the refusal is an ordinary failure.
    RejectKey,
    /// The prompt is too long for this endpoint: fail over only to larger windows; learn the
    /// window the error states.
    ContextSkip,
    /// Not the endpoint's fault (nothing counted): fail over.
    FailOver,
    /// The endpoint speaks only chat: mark it so and try it again at once by translation.
    SpeakChat,
    /// The endpoint no longer holds the conversation the request continues: send it the whole
    /// conversation at once (when the gateway kept it), else fail over. Nothing counted.
    Replay,
}

/// What the outcome alone does not say.
#[derive(Clone, Copy, Debug, Default)]
pub struct Hints {
    /// How long the upstream asked us to stay away (a 429's `Retry-After` etc., clamped).
    pub retry_after: Option<Duration>,
    /// The endpoint's own `cooldown:`.
    pub endpoint_cooldown: Option<Duration>,
    /// `routing_policy.default_cooldown`.
    pub default_cooldown: Duration,
    /// The attempt was made with one of the endpoint's keys.
    pub with_key: bool,
}

/// The policy table. Pure: no clock, no state, no I/O.
pub fn action(outcome: Outcome, hints: Hints) -> Action {
    match outcome {
        Outcome::Ok => Action::Serve,
        Outcome::Client => Action::ReturnToClient,
        Outcome::ContextLength => Action::ContextSkip,
        Outcome::RateLimited => Action::CoolDown(
            hints
                .retry_after
                .or(hints.endpoint_cooldown)
                .unwrap_or(hints.default_cooldown),
        ),
        Outcome::Gone => Action::Retire,
        Outcome::ResponsesUnsupported => Action::SpeakChat,
        Outcome::PreviousResponseLost => Action::Replay,
        Outcome::Auth if hints.with_key => Action::RejectKey,
        // The rest by the outcome's own properties, so each set is written once: failures that
        // count are recorded (retried on the same endpoint when that may help; never after a
        // stream committed, nor a keyless 401 or a missing model); the others just fail over.
        o if o.counts_against_endpoint() => Action::Fail {
            retry: o.retryable_same_endpoint(),
        },
        _ => Action::FailOver,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn hints() -> Hints {
        Hints {
            retry_after: None,
            endpoint_cooldown: None,
            default_cooldown: 30 * S,
            with_key: true,
        }
    }

    #[test]
    fn strings_are_the_audit_contract() {
        // The exact strings stored in `attempts.class` before this enum existed.
        let expected = [
            (Outcome::Ok, "ok"),
            (Outcome::Connect, "connect_error"),
            (Outcome::Connection, "connection_error"),
            (Outcome::Timeout, "timeout"),
            (Outcome::FirstTokenTimeout, "first_token_timeout"),
            (Outcome::Server, "server_error"),
            (Outcome::RateLimited, "rate_limited"),
            (Outcome::Gone, "gone"),
            (Outcome::Auth, "auth_failed"),
            (Outcome::ContextLength, "context_length"),
            (Outcome::ModelMissing, "model_missing"),
            (Outcome::Client, "client_error"),
            (Outcome::InBand, "stream_error_event"),
            (Outcome::Malformed, "malformed_response"),
            (Outcome::Unsupported, "unsupported_request"),
            (Outcome::ResponsesUnsupported, "responses_unsupported"),
            (Outcome::PreviousResponseLost, "previous_response_lost"),
            (Outcome::SkippedRetired, "skipped_retired"),
            (Outcome::SkippedAuthFailed, "skipped_auth_failed"),
            (Outcome::SkippedCooldown, "skipped_cooldown"),
            (Outcome::SkippedCapability, "skipped_capability"),
            (Outcome::SkippedUnhealthy, "skipped_unhealthy"),
            (
                Outcome::SkippedRatelimitPredicted,
                "skipped_ratelimit_predicted",
            ),
            (Outcome::ContextSkip, "context_skip"),
            (Outcome::SkippedNotAllowed, "skipped_not_allowed"),
            (Outcome::SkippedPinned, "skipped_pinned"),
            (Outcome::StreamBroken, "stream_broken"),
            (Outcome::StreamStalled, "stream_stalled"),
            (Outcome::StreamTruncated, "stream_truncated"),
            (Outcome::StreamTimeout, "stream_timeout"),
            (Outcome::HedgeCancelled, "hedge_cancelled"),
            (Outcome::ClientClosed, "client_closed"),
            (Outcome::Shutdown, "shutdown"),
            (Outcome::InternalPanic, "internal_panic"),
            (Outcome::OutOfFiles, "gateway_out_of_files"),
        ];
        for (o, s) in expected {
            assert_eq!(o.as_str(), s);
            assert_eq!(o.to_string(), s, "Display is the contract string too");
            assert_eq!(serde_json::to_value(o).unwrap(), serde_json::json!(s));
        }
        // Every variant is listed above (a new one must get its string on purpose).
        for o in Outcome::ALL {
            assert!(
                expected.iter().any(|(e, _)| *e == o),
                "{o:?} has no contract row"
            );
        }
        // And the strings are distinct: a query by class finds one kind of outcome.
        let mut strings: Vec<&str> = expected.iter().map(|(o, _)| o.as_str()).collect();
        strings.sort();
        strings.dedup();
        assert_eq!(strings.len(), expected.len());
        for (o, s) in expected {
            assert_eq!(s.parse::<Outcome>(), Ok(o));
        }
        assert!("skipped_".parse::<Outcome>().is_err());
    }

    #[test]
    fn an_endpoint_without_responses_is_spoken_to_in_chat_and_a_lost_pin_is_not_its_fault() {
        assert_eq!(
            action(Outcome::ResponsesUnsupported, hints()),
            Action::SpeakChat
        );
        assert_eq!(
            action(Outcome::PreviousResponseLost, hints()),
            Action::Replay
        );
        for o in [Outcome::ResponsesUnsupported, Outcome::PreviousResponseLost] {
            assert!(!o.counts_against_endpoint(), "{o:?}");
            assert!(!o.is_skip(), "{o:?}: it was called");
        }
        assert!(Outcome::SkippedPinned.is_skip());
    }

    #[test]
    fn only_a_size_refusal_or_skip_is_about_context() {
        for o in Outcome::ALL {
            assert_eq!(
                o.is_context(),
                matches!(o, Outcome::ContextLength | Outcome::ContextSkip),
                "{o:?}"
            );
        }
    }

    #[test]
    fn skips_are_exactly_the_uncalled_outcomes() {
        for o in Outcome::ALL {
            assert_eq!(
                o.is_skip(),
                o.as_str().starts_with("skipped_") || o == Outcome::ContextSkip,
                "{o:?}"
            );
        }
    }

    // README "What each error does", one test per row.

    #[test]
    fn connect_timeout_5xx_malformed_fail_over_with_retries_and_count() {
        for o in [
            Outcome::Connect,
            Outcome::Connection,
            Outcome::Timeout,
            Outcome::Server,
            Outcome::Malformed,
        ] {
            assert_eq!(action(o, hints()), Action::Fail { retry: true }, "{o:?}");
            assert!(o.counts_against_endpoint(), "{o:?}");
        }
    }

    #[test]
    fn stream_failures_before_the_commit_fail_over_and_count() {
        for o in [
            Outcome::InBand,
            Outcome::FirstTokenTimeout,
            Outcome::Connection,
        ] {
            assert_eq!(action(o, hints()), Action::Fail { retry: true }, "{o:?}");
            assert!(o.counts_against_endpoint());
        }
    }

    #[test]
    fn stream_failures_after_the_commit_are_recorded_never_retried() {
        for o in [
            Outcome::StreamBroken,
            Outcome::StreamStalled,
            Outcome::StreamTruncated,
            Outcome::StreamTimeout,
        ] {
            assert_eq!(action(o, hints()), Action::Fail { retry: false }, "{o:?}");
            assert!(o.counts_against_endpoint());
            assert!(!o.retryable_same_endpoint());
        }
    }

    #[test]
    fn a_429_cools_down_for_the_upstreams_hint_then_the_endpoints_then_the_default() {
        let mut h = hints();
        assert_eq!(
            action(Outcome::RateLimited, h),
            Action::CoolDown(30 * S),
            "no hint: default_cooldown"
        );
        h.endpoint_cooldown = Some(5 * S);
        assert_eq!(action(Outcome::RateLimited, h), Action::CoolDown(5 * S));
        h.retry_after = Some(2 * S);
        assert_eq!(action(Outcome::RateLimited, h), Action::CoolDown(2 * S));
        assert!(!Outcome::RateLimited.counts_against_endpoint());
        assert!(!Outcome::RateLimited.retryable_same_endpoint());
    }

    #[test]
    fn a_410_retires() {
        assert_eq!(action(Outcome::Gone, hints()), Action::Retire);
    }

    #[test]
    fn a_401_rejects_the_key_and_without_a_key_is_a_failure() {
        assert_eq!(action(Outcome::Auth, hints()), Action::RejectKey);
        let h = Hints {
            with_key: false,
            ..hints()
        };
        assert_eq!(action(Outcome::Auth, h), Action::Fail { retry: false });
    }

    #[test]
    fn a_missing_model_404_counts_and_fails_over() {
        assert_eq!(
            action(Outcome::ModelMissing, hints()),
            Action::Fail { retry: false }
        );
        assert!(Outcome::ModelMissing.counts_against_endpoint());
    }

    #[test]
    fn a_context_length_400_skips_for_context_without_counting() {
        assert_eq!(action(Outcome::ContextLength, hints()), Action::ContextSkip);
        assert!(!Outcome::ContextLength.counts_against_endpoint());
        assert!(Outcome::ContextLength.is_context() && Outcome::ContextSkip.is_context());
    }

    #[test]
    fn any_other_4xx_goes_back_to_the_client_uncounted() {
        assert_eq!(action(Outcome::Client, hints()), Action::ReturnToClient);
        assert!(!Outcome::Client.counts_against_endpoint());
    }

    #[test]
    fn an_inexpressible_request_fails_over_uncounted() {
        assert_eq!(action(Outcome::Unsupported, hints()), Action::FailOver);
        assert!(!Outcome::Unsupported.counts_against_endpoint());
    }

    #[test]
    fn a_cancelled_hedge_counts_nothing_and_is_no_skip() {
        // The loser of a race did nothing wrong: it was merely slower than the winner.
        assert!(!Outcome::HedgeCancelled.counts_against_endpoint());
        assert!(!Outcome::HedgeCancelled.is_skip());
        assert_eq!(action(Outcome::HedgeCancelled, hints()), Action::FailOver);
    }

    #[test]
    fn the_gateway_out_of_descriptors_fails_over_counting_nothing_against_the_endpoint() {
        // Its own trouble: an endpoint is not to blame, nor worth a second try on the spot.
        assert_eq!(action(Outcome::OutOfFiles, hints()), Action::FailOver);
        assert!(!Outcome::OutOfFiles.counts_against_endpoint());
        assert!(!Outcome::OutOfFiles.retryable_same_endpoint());
        assert!(!Outcome::OutOfFiles.is_skip());
    }

    #[test]
    fn cut_requests_and_skips_count_nothing() {
        for o in Outcome::ALL.into_iter().filter(|o| {
            o.is_skip()
                || matches!(
                    o,
                    Outcome::ClientClosed | Outcome::Shutdown | Outcome::InternalPanic
                )
        }) {
            assert!(!o.counts_against_endpoint(), "{o:?}");
            assert_eq!(action(o, hints()), Action::FailOver, "{o:?}");
        }
    }

    #[test]
    fn only_ok_serves() {
        for o in Outcome::ALL {
            assert_eq!(
                action(o, hints()) == Action::Serve,
                o == Outcome::Ok,
                "{o:?}"
            );
        }
    }
}
