//! The agent's HTTP endpoints. `/metrics`, `/healthz` and `/readyz` are
//! read-only and open; `/capture` and `/captures` start work as root. Who
//! may use them:
//! - over the unix socket (`--socket`): whoever can connect, i.e. what the
//!   socket file's permissions allow (root, or `--socket-group`);
//! - over TCP with `--token-file`: whoever presents the bearer token;
//! - over TCP without a token: loopback peers, unless `--socket` is given;
//!   then TCP is metrics-only (any local user can reach 127.0.0.1, the
//!   socket is the narrower door).
use std::{
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
};

use axum::{
    Extension, Json, Router,
    body::Bytes,
    extract::{ConnectInfo, DefaultBodyLimit, FromRequestParts, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::json;

use super::{
    Shared,
    capture::{self, Refused, Request},
};

/// The routes (the Kubernetes probes and the PodMonitor name them too:
/// tests/deploy_manifests.rs checks they agree).
pub const METRICS: &str = "/metrics";
pub const HEALTHZ: &str = "/healthz";
pub const READYZ: &str = "/readyz";
pub const CAPTURE: &str = "/capture";
pub const CAPTURES: &str = "/captures";

/// Largest request body: a capture request is a few hundred bytes.
const MAX_BODY: usize = 64 * 1024;

/// Marks requests that came in over the unix socket (a layer on that
/// router only; TCP requests carry `ConnectInfo<SocketAddr>` instead).
#[derive(Clone, Copy)]
pub struct ViaUnixSocket;

/// Where a request came from.
enum Peer {
    Unix,
    Tcp(SocketAddr),
    /// Neither marker: a server set up without its peer information.
    Unknown,
}

impl<S: Send + Sync> FromRequestParts<S> for Peer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        let e = &parts.extensions;
        Ok(if e.get::<ViaUnixSocket>().is_some() {
            Peer::Unix
        } else if let Some(ConnectInfo(a)) = e.get::<ConnectInfo<SocketAddr>>() {
            Peer::Tcp(*a)
        } else {
            Peer::Unknown
        })
    }
}

/// The routes for the TCP listener (served with `ConnectInfo<SocketAddr>`).
pub fn router(shared: Arc<Shared>) -> Router {
    routes(shared)
}

/// The same routes for the unix socket.
pub fn unix_router(shared: Arc<Shared>) -> Router {
    routes(shared).layer(Extension(ViaUnixSocket))
}

fn routes(shared: Arc<Shared>) -> Router {
    Router::new()
        .route(METRICS, get(metrics))
        .route(HEALTHZ, get(|| async { "ok\n" }))
        .route(READYZ, get(readyz))
        .route(CAPTURE, post(post_capture))
        .route(CAPTURES, get(get_captures))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(shared)
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(json!({"error": msg.into()}))).into_response()
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

async fn readyz(State(s): State<Arc<Shared>>) -> Response {
    if s.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "first scan not done yet\n").into_response()
    }
}

/// Equal-time comparison: the token's bytes are not revealed by timing.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Who may start captures (the module's rules). The refusal, if any.
fn denied(s: &Shared, peer: Peer, headers: &HeaderMap) -> Option<Response> {
    let peer = match peer {
        Peer::Unix => return None,
        Peer::Tcp(a) => a,
        Peer::Unknown => {
            return Some(error(
                StatusCode::FORBIDDEN,
                "the peer of this connection is unknown",
            ));
        }
    };
    let r: Result<(), Response> = match &s.cfg.token {
        Some(tok) => {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            match given {
                Some(g) if same(g.trim().as_bytes(), tok.as_bytes()) => Ok(()),
                _ => Err((
                    StatusCode::UNAUTHORIZED,
                    [(header::WWW_AUTHENTICATE, "Bearer")],
                    Json(json!({"error": "capture requests need `Authorization: Bearer <token>` (the agent's --token-file)"})),
                )
                    .into_response()),
            }
        }
        None if s.cfg.socket.is_some() => Err(error(
            StatusCode::FORBIDDEN,
            "capture requests go to the agent's unix socket (--socket); TCP serves metrics only without --token-file",
        )),
        None if peer.ip().is_loopback() => Ok(()),
        None => Err(error(
            StatusCode::FORBIDDEN,
            "capture requests are accepted from loopback only (no --token-file)",
        )),
    };
    r.err()
}

async fn get_captures(State(s): State<Arc<Shared>>, peer: Peer, headers: HeaderMap) -> Response {
    if let Some(r) = denied(&s, peer, &headers) {
        return r;
    }
    let list = s.lock().captures.clone();
    Json(list).into_response()
}

async fn post_capture(
    State(s): State<Arc<Shared>>,
    peer: Peer,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = denied(&s, peer, &headers) {
        return r;
    }
    let req: Request = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!(
                    "malformed capture request: {e}; expected e.g. {{\"job\": \"4242\", \"warmup\": 1, \"active\": 3}}"
                ),
            );
        }
    };
    match capture::accept(&s, req, None) {
        Ok(rec) => (StatusCode::ACCEPTED, Json(rec)).into_response(),
        Err(Refused(code, msg)) => error(
            StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST),
            msg,
        ),
    }
}
