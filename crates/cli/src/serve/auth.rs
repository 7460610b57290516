//! Bearer tokens: a full one for every call, a read-only one for reads.
//! A handler names what it needs by taking [`CanRead`] or [`CanWrite`];
//! without the right token the request ends as a 401 (no or unknown
//! token) or 403 (a read-only token on a write) before the handler runs.

use std::future::{ready, Ready};

use actix_web::{dev::Payload, web, FromRequest, HttpRequest};

use super::api::ApiError;
use super::ServeState;

/// The tokens a server accepts. No full token: every call is allowed (the
/// server is on a loopback address; see `ServeConfig::check`).
#[derive(Clone, Default)]
pub(crate) struct Tokens {
    full: Option<String>,
    read: Option<String>,
}

/// What a request's token allows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Access {
    Read,
    Write,
}

impl Tokens {
    pub(crate) fn new(full: Option<String>, read: Option<String>) -> Self {
        Tokens { full, read }
    }

    /// What the `Authorization` header's token allows.
    pub(crate) fn access(&self, header: Option<&str>) -> Result<Access, ApiError> {
        let Some(full) = &self.full else {
            return Ok(Access::Write);
        };
        let Some(header) = header else {
            return Err(ApiError::unauthorized(
                "this server needs a bearer token: send `Authorization: Bearer <token>`",
            ));
        };
        // The scheme's name is case-insensitive (RFC 9110, section 11.1).
        let scheme = header.get(..7).unwrap_or("");
        let given = match scheme.eq_ignore_ascii_case("bearer ") {
            true => header.get(7..),
            false => None,
        };
        let Some(given) = given else {
            return Err(ApiError::unauthorized(
                "the Authorization header must be `Bearer <token>`",
            ));
        };
        let given = given.trim();
        if same(given, full) {
            return Ok(Access::Write);
        }
        if self.read.as_deref().is_some_and(|r| same(given, r)) {
            return Ok(Access::Read);
        }
        Err(ApiError::unauthorized("the bearer token is not valid"))
    }

    /// Whether any token is needed.
    pub(crate) fn required(&self) -> bool {
        self.full.is_some()
    }
}

/// Compares without stopping at the first difference, so the time taken
/// says nothing of how much of a guess was right.
fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

fn access_of(req: &HttpRequest) -> Result<Access, ApiError> {
    let state = req
        .app_data::<web::Data<ServeState>>()
        .expect("configure() registers the state");
    if !state.tokens.required() {
        local_only(req)?;
    }
    let header = req
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    state.tokens.access(header)
}

/// Whether `host` (a Host header's or an Origin's host, port stripped)
/// names this machine's loopback.
fn loopback_name(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(super::is_loopback)
}

/// Without a token the API trusts only this machine, so it answers only
/// requests addressed to a loopback name (a page whose DNS name was
/// rebound to 127.0.0.1 sends its own name) and, from a browser, only
/// pages served from a loopback origin.
fn local_only(req: &HttpRequest) -> Result<(), ApiError> {
    let header = |name| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let host = header(actix_web::http::header::HOST).unwrap_or_default();
    if !host.is_empty() && !loopback_name(&host) {
        return Err(ApiError::forbidden(
            "this server has no token and answers only requests to localhost; serve with --token to be reached by another name",
        ));
    }
    if let Some(origin) = header(actix_web::http::header::ORIGIN) {
        let host_of_origin = origin
            .split_once("://")
            .map_or(origin.as_str(), |(_, rest)| rest);
        if origin != "null" && !loopback_name(host_of_origin) {
            return Err(ApiError::forbidden(
                "a page from another origin may not call this server",
            ));
        }
    }
    Ok(())
}

/// The request may read.
pub(crate) struct CanRead;

impl FromRequest for CanRead {
    type Error = ApiError;
    type Future = Ready<Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(access_of(req).map(|_| CanRead))
    }
}

/// The request may change state.
pub(crate) struct CanWrite;

impl FromRequest for CanWrite {
    type Error = ApiError;
    type Future = Ready<Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(access_of(req).and_then(|a| match a {
            Access::Write => Ok(CanWrite),
            Access::Read => Err(ApiError::forbidden(
                "this token may only read; signals, starts, cancels and the like need the full token",
            )),
        }))
    }
}

#[cfg(test)]
mod tests {
    //! Goal: the token check lets exactly the right callers in. Method:
    //! every combination of configured and given tokens.

    use super::*;

    #[test]
    fn only_loopback_names_count_as_local() {
        for local in [
            "localhost",
            "localhost:8233",
            "127.0.0.1:8233",
            "[::1]:8233",
            "[::1]",
            "LOCALHOST",
        ] {
            assert!(loopback_name(local), "{local}");
        }
        for remote in [
            "evil.example:8233",
            "10.0.0.1:80",
            "127.0.0.1.evil.example",
            "[2001:db8::1]:1",
        ] {
            assert!(!loopback_name(remote), "{remote}");
        }
    }

    #[test]
    fn tokens_grant_what_they_should() {
        let open = Tokens::default();
        assert_eq!(open.access(None).unwrap(), Access::Write);
        let t = Tokens::new(
            Some("full-token-0123456789".into()),
            Some("read-token-0123456789".into()),
        );
        assert!(t.access(None).is_err());
        assert!(t.access(Some("full-token-0123456789")).is_err());
        assert!(t.access(Some("Bearer wrong")).is_err());
        assert_eq!(
            t.access(Some("bearer full-token-0123456789")).unwrap(),
            Access::Write
        );
        assert!(t.access(Some("Bearer full-token-012345678")).is_err());
        assert_eq!(
            t.access(Some("Bearer full-token-0123456789")).unwrap(),
            Access::Write
        );
        assert_eq!(
            t.access(Some("Bearer read-token-0123456789")).unwrap(),
            Access::Read
        );
    }
}
