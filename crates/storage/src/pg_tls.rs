//! TLS between the PostgreSQL store and its server, with libpq's settings.
//!
//! A connection string may carry libpq's TLS parameters, with libpq's
//! meaning (`sslmode` defaults to `prefer`, as in libpq):
//!
//! | `sslmode` | encrypted | server certificate checked |
//! |---|---|---|
//! | `disable` | never | no |
//! | `allow`, `prefer` | when the server offers it | no |
//! | `require` | always | no (but as `verify-ca` when `sslrootcert` is given) |
//! | `verify-ca` | always | signed by the root in `sslrootcert` (required) |
//! | `verify-full` | always | signed by a trusted root, and names the host |
//!
//! `sslrootcert` names a PEM file of trusted roots, or `system` for the
//! operating system's store, which is also the default for `verify-full`
//! (libpq reads `~/.postgresql/root.crt` instead). As in libpq, `system`
//! implies `verify-full` and refuses weaker modes: any public certificate
//! chains to those roots, so only the host name check makes them mean
//! anything; for the same reason `verify-ca` needs a root file. `sslcert`
//! and `sslkey` name the client's certificate chain and key (PEM), for
//! servers that authenticate clients by certificate. Under `prefer`, a
//! refused handshake is followed by a connection without TLS; over Unix
//! sockets (no TLS there) `sslmode` is ignored, as libpq does.
//!
//! `tokio-postgres` knows only `disable`, `prefer` and `require` and none
//! of the file parameters, so [`split`] takes keel's TLS parameters out of
//! the string before the driver parses the rest, and [`Tls`] is the
//! driver's TLS connector, over rustls. Channel binding
//! (`SCRAM-SHA-256-PLUS`) is not offered: authentication uses plain
//! `SCRAM-SHA-256` inside the encrypted connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

/// Longest certificate or key file keel reads.
pub const PG_TLS_FILE_BYTES_MAX: u64 = 1 << 20;

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// The TLS parameters of a connection string.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsParams {
    pub mode: Option<TlsMode>,
    pub root_cert: Option<String>,
    pub cert: Option<String>,
    pub key: Option<String>,
}

/// What is wrong with a connection string's TLS settings.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("sslmode {0:?} is not one of disable, allow, prefer, require, verify-ca, verify-full")]
    Mode(String),
    #[error("{param} {path:?}: {detail}")]
    File {
        param: &'static str,
        path: String,
        detail: String,
    },
    #[error("sslrootcert=system needs sslmode=verify-full: any public certificate chains to the system's roots, so only the host name check makes them mean anything")]
    WeakSystemRoots,
    #[error("sslmode=verify-ca needs sslrootcert=<file> (the authority that signed the server's certificate); with the system's roots use verify-full")]
    VerifyCaWithoutRoot,
    #[error("sslcert and sslkey go together: {0} is missing")]
    HalfClientCert(&'static str),
    #[error(
        "no trusted root certificates in the system's store ({0}); name a file with sslrootcert"
    )]
    NoSystemRoots(String),
    #[error("TLS settings: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Splits keel's TLS parameters out of `url` (a `postgres://` URL or a
/// `key=value` string), returning the rest for the driver to parse.
pub fn split(url: &str) -> Result<(String, TlsParams), TlsConfigError> {
    let mut params = TlsParams::default();
    let mut take = |key: &str, value: String| -> Result<bool, TlsConfigError> {
        match key {
            "sslmode" => {
                params.mode = Some(match value.as_str() {
                    "disable" => TlsMode::Disable,
                    "allow" | "prefer" => TlsMode::Prefer,
                    "require" => TlsMode::Require,
                    "verify-ca" => TlsMode::VerifyCa,
                    "verify-full" => TlsMode::VerifyFull,
                    _ => return Err(TlsConfigError::Mode(value)),
                })
            }
            "sslrootcert" => params.root_cert = Some(value),
            "sslcert" => params.cert = Some(value),
            "sslkey" => params.key = Some(value),
            _ => return Ok(false),
        }
        Ok(true)
    };
    let rest = if let Some(scheme_end) = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .map(|rest| url.len() - rest.len())
    {
        // The query starts after the credentials, whose password may
        // itself hold a `?`.
        let after = url[scheme_end..]
            .rfind('@')
            .map_or(scheme_end, |at| scheme_end + at + 1);
        match url[after..].find('?').map(|q| after + q) {
            None => url.to_string(),
            Some(q) => {
                let (base, query) = (&url[..q], &url[q + 1..]);
                let mut kept = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    if !take(&percent_decode(k), percent_decode(v))? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    base.to_string()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else {
        let mut rest = String::with_capacity(url.len());
        for (raw, key, value) in key_values(url) {
            if !take(key, value)? {
                if !rest.is_empty() {
                    rest.push(' ');
                }
                rest.push_str(raw);
            }
        }
        rest
    };
    Ok((rest, params))
}

/// The `key = value` pairs of a libpq key/value string, each with its
/// text as written (kept as is when it is not keel's), read as libpq
/// reads them: spaces around `=`, values in single quotes, backslash
/// escapes. A malformed tail is kept as text for the driver to refuse.
fn key_values(s: &str) -> Vec<(&str, &str, String)> {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let skip_spaces = |i: &mut usize| {
        while *i < bytes.len() && bytes[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    loop {
        skip_spaces(&mut i);
        if i >= bytes.len() {
            return out;
        }
        let start = i;
        while i < bytes.len() && bytes[i] != b'=' && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = &s[start..i];
        skip_spaces(&mut i);
        if i >= bytes.len() || bytes[i] != b'=' {
            out.push((&s[start..], "", String::new()));
            return out;
        }
        i += 1;
        skip_spaces(&mut i);
        let mut value = Vec::new();
        let quoted = i < bytes.len() && bytes[i] == b'\'';
        if quoted {
            i += 1;
        }
        while i < bytes.len() {
            let b = bytes[i];
            if quoted && b == b'\'' {
                i += 1;
                break;
            }
            if !quoted && b.is_ascii_whitespace() {
                break;
            }
            if b == b'\\' && i + 1 < bytes.len() {
                i += 1;
            }
            value.push(bytes[i]);
            i += 1;
        }
        out.push((
            &s[start..i],
            key,
            String::from_utf8_lossy(&value).into_owned(),
        ));
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The driver's settings and TLS connector for a connection string; the
/// error says what is wrong with it.
pub fn driver_config(url: &str) -> Result<(tokio_postgres::Config, Tls), String> {
    let (rest, params) = split(url).map_err(|e| e.to_string())?;
    let mut config = rest
        .parse::<tokio_postgres::Config>()
        .map_err(|e| e.to_string())?;
    if params.mode.is_none() && config.get_ssl_mode() != SslMode::Prefer {
        // The driver read an `sslmode` keel did not see: keel's mode would
        // silently replace it.
        return Err(
            "sslmode is written in a way keel cannot read; write it as sslmode=<mode>".into(),
        );
    }
    let (tls, mut mode) = connector(&params).map_err(|e| e.to_string())?;
    let all_unix = {
        use tokio_postgres::config::Host;
        let hosts = config.get_hosts();
        !hosts.is_empty() && hosts.iter().all(|h| !matches!(h, Host::Tcp(_)))
    };
    if all_unix {
        // PostgreSQL has no TLS over Unix sockets; libpq ignores sslmode
        // there, and so does keel.
        mode = SslMode::Disable;
    }
    config.ssl_mode(mode);
    Ok((config, tls))
}

/// The driver's TLS connector for a connection string's parameters, and
/// the `sslmode` to give the driver. Reads the certificate files now, so a
/// missing or malformed one is reported at open, naming the file.
pub fn connector(params: &TlsParams) -> Result<(Tls, SslMode), TlsConfigError> {
    let system = params.root_cert.as_deref() == Some("system");
    let mode = match (params.mode, &params.root_cert) {
        // libpq: the system's roots are only safe with the host name
        // checked, so they imply `verify-full` and refuse anything weaker.
        (None, Some(_)) if system => TlsMode::VerifyFull,
        (Some(m), _) if system && m != TlsMode::VerifyFull => {
            return Err(TlsConfigError::WeakSystemRoots)
        }
        (None, _) => TlsMode::Prefer,
        // libpq: `require` with a root certificate file behaves as `verify-ca`.
        (Some(TlsMode::Require), Some(_)) => TlsMode::VerifyCa,
        // Any public certificate chains to the system's roots: without the
        // host name check, only a root of one's own means anything.
        (Some(TlsMode::VerifyCa), None) => return Err(TlsConfigError::VerifyCaWithoutRoot),
        (Some(m), _) => m,
    };
    let driver_mode = match mode {
        TlsMode::Disable => SslMode::Disable,
        TlsMode::Prefer => SslMode::Prefer,
        _ => SslMode::Require,
    };
    if mode == TlsMode::Disable {
        return Ok((Tls { config: None }, driver_mode));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match mode {
        TlsMode::Prefer | TlsMode::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider))),
        TlsMode::VerifyCa | TlsMode::VerifyFull => {
            let roots = Arc::new(roots(params.root_cert.as_deref())?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| TlsConfigError::Rustls(rustls::Error::General(e.to_string())))?;
            if mode == TlsMode::VerifyFull {
                builder.with_webpki_verifier(webpki)
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyName(webpki)))
            }
        }
        TlsMode::Disable => unreachable!("handled above"),
    };
    let config = match (&params.cert, &params.key) {
        (None, None) => builder.with_no_client_auth(),
        (Some(_), None) => return Err(TlsConfigError::HalfClientCert("sslkey")),
        (None, Some(_)) => return Err(TlsConfigError::HalfClientCert("sslcert")),
        (Some(cert), Some(key)) => {
            let chain = certificates("sslcert", cert)?;
            let bytes = read("sslkey", key)?;
            let key = PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsConfigError::File {
                param: "sslkey",
                path: key.clone(),
                detail: format!("no private key in it ({e})"),
            })?;
            builder.with_client_auth_cert(chain, key)?
        }
    };
    Ok((
        Tls {
            config: Some(Arc::new(config)),
        },
        driver_mode,
    ))
}

fn read(param: &'static str, path: &str) -> Result<Vec<u8>, TlsConfigError> {
    let file = |detail: String| TlsConfigError::File {
        param,
        path: path.to_string(),
        detail,
    };
    let len = std::fs::metadata(path)
        .map_err(|e| file(e.to_string()))?
        .len();
    if len > PG_TLS_FILE_BYTES_MAX {
        return Err(file(format!(
            "{len} bytes, more than the {PG_TLS_FILE_BYTES_MAX} a certificate file may have"
        )));
    }
    std::fs::read(path).map_err(|e| file(e.to_string()))
}

fn certificates(
    param: &'static str,
    path: &str,
) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let bytes = read(param, path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsConfigError::File {
            param,
            path: path.to_string(),
            detail: format!("not PEM certificates ({e})"),
        })?;
    if certs.is_empty() {
        return Err(TlsConfigError::File {
            param,
            path: path.to_string(),
            detail: "no certificate in it".into(),
        });
    }
    Ok(certs)
}

fn roots(root_cert: Option<&str>) -> Result<RootCertStore, TlsConfigError> {
    let mut store = RootCertStore::empty();
    match root_cert {
        None | Some("system") => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _ignored) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map(|e| e.to_string())
                    .unwrap_or_else(|| "none found".into());
                return Err(TlsConfigError::NoSystemRoots(why));
            }
        }
        Some(path) => {
            for cert in certificates("sslrootcert", path)? {
                store.add(cert).map_err(|e| TlsConfigError::File {
                    param: "sslrootcert",
                    path: path.to_string(),
                    detail: format!("not a usable root certificate ({e})"),
                })?;
            }
        }
    }
    Ok(store)
}

/// `prefer` and `require`: the connection is encrypted and the server
/// proves it holds the key of the certificate it shows, but nothing says
/// whose certificate it is (libpq's meaning of these modes).
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the certificate must chain to a trusted root, whatever
/// host name it is for.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The driver's TLS connector: `None` when TLS is disabled (the driver
/// never asks for it then).
#[derive(Clone, Debug)]
pub struct Tls {
    config: Option<Arc<rustls::ClientConfig>>,
}

impl Tls {
    /// A connector for no TLS at all.
    pub fn disabled() -> Self {
        Tls { config: None }
    }
}

/// A TLS failure: the handshake failed or the server's certificate is not
/// trusted. [`is_tls_failure`] finds it in a driver error's causes.
#[derive(Debug, thiserror::Error)]
#[error("TLS to {host}: {source}")]
pub struct TlsFailure {
    host: String,
    source: io::Error,
}

/// Connects with `config`; under `sslmode=prefer`, a refused TLS handshake
/// is followed by a connection without TLS, as libpq does.
pub async fn connect(
    config: &tokio_postgres::Config,
    tls: Tls,
) -> Result<
    (
        tokio_postgres::Client,
        tokio_postgres::Connection<tokio_postgres::Socket, TlsStream<tokio_postgres::Socket>>,
    ),
    tokio_postgres::Error,
> {
    match config.connect(tls.clone()).await {
        Err(e) if config.get_ssl_mode() == SslMode::Prefer && is_tls_refusal(&e) => {
            tracing::debug!(error = %e, "TLS refused under sslmode=prefer; connecting without it");
            let mut plain = config.clone();
            plain.ssl_mode(SslMode::Disable);
            plain.connect(tls).await
        }
        other => other,
    }
}

/// Whether a driver error is a TLS handshake the client or the server
/// refused (an untrusted certificate, no common protocol, a server without
/// TLS when it is required), which trying again will not fix; a connection
/// that broke during the handshake is not.
pub fn is_tls_refusal(e: &tokio_postgres::Error) -> bool {
    // The driver's own refusals ("server does not support TLS") carry no
    // typed cause, only its TLS kind, whose text is fixed.
    let driver_tls = e.to_string().contains("TLS handshake");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(failure) = s.downcast_ref::<TlsFailure>() {
            // rustls's refusals come as `InvalidData`; a connection that
            // broke mid-handshake as an I/O error of another kind.
            return matches!(
                failure.source.kind(),
                io::ErrorKind::InvalidData
                    | io::ErrorKind::InvalidInput
                    | io::ErrorKind::Unsupported
            );
        }
        source = s.source();
    }
    driver_tls
}

impl<S> MakeTlsConnect<S> for Tls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = TlsStream<S>;
    type TlsConnect = Connect;
    type Error = std::convert::Infallible;

    // The driver asks for a connector for every host before it knows
    // whether TLS will be used (never with `sslmode=disable`, nor over a
    // Unix socket), so nothing here may fail: [`Connect::connect`] does.
    fn make_tls_connect(&mut self, domain: &str) -> Result<Connect, Self::Error> {
        Ok(Connect {
            config: self.config.clone(),
            host: domain.to_string(),
        })
    }
}

/// One connection's TLS handshake.
#[derive(Debug)]
pub struct Connect {
    config: Option<Arc<rustls::ClientConfig>>,
    host: String,
}

impl<S> TlsConnect<S> for Connect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = TlsStream<S>;
    type Error = TlsFailure;
    type Future = Pin<Box<dyn Future<Output = Result<TlsStream<S>, TlsFailure>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        let host = self.host;
        let failure = |host: String, kind, detail: &str| TlsFailure {
            host,
            source: io::Error::new(kind, detail.to_string()),
        };
        let Some(config) = self.config else {
            let e = failure(host, io::ErrorKind::Unsupported, "TLS is disabled");
            return Box::pin(async move { Err(e) });
        };
        let Ok(name) = ServerName::try_from(host.clone()) else {
            let e = failure(
                host,
                io::ErrorKind::InvalidInput,
                "not a host name TLS can check",
            );
            return Box::pin(async move { Err(e) });
        };
        let connector = tokio_rustls::TlsConnector::from(config);
        Box::pin(async move {
            connector
                .connect(name, stream)
                .await
                .map(TlsStream)
                .map_err(|source| TlsFailure { host, source })
        })
    }
}

/// An encrypted connection to the server.
#[derive(Debug)]
pub struct TlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for TlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for TlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    // Goal: keel's TLS parameters come out of both connection string forms
    // with libpq's meaning, and everything else is left to the driver.
    use super::*;

    #[test]
    fn tls_parameters_come_out_of_urls_and_key_value_strings() {
        let (rest, p) = split(
            "postgres://u:p@db.example:5432/app?sslmode=verify-full&application_name=x&sslrootcert=%2Ftmp%2Fca.pem",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgres://u:p@db.example:5432/app?application_name=x"
        );
        assert_eq!(p.mode, Some(TlsMode::VerifyFull));
        assert_eq!(p.root_cert.as_deref(), Some("/tmp/ca.pem"));

        let (rest, p) = split("postgres://u@h/db?sslmode=require").unwrap();
        assert_eq!(rest, "postgres://u@h/db");
        assert_eq!(p.mode, Some(TlsMode::Require));

        let (rest, p) =
            split("host=h user=u sslmode=verify-ca sslcert=/c.pem sslkey='/k.pem' dbname=d")
                .unwrap();
        assert_eq!(rest, "host=h user=u dbname=d");
        assert_eq!(p.mode, Some(TlsMode::VerifyCa));
        assert_eq!(p.cert.as_deref(), Some("/c.pem"));
        assert_eq!(p.key.as_deref(), Some("/k.pem"));

        let (rest, p) = split("postgres://u@h/db").unwrap();
        assert_eq!(rest, "postgres://u@h/db");
        assert_eq!(p, TlsParams::default());

        // A `?` in the password is not the query.
        let (rest, p) = split("postgres://u:pa?ss@h/db?sslmode=require").unwrap();
        assert_eq!(rest, "postgres://u:pa?ss@h/db");
        assert_eq!(p.mode, Some(TlsMode::Require));

        // libpq's key/value syntax: spaces around `=`, quotes, escapes;
        // what is not keel's is kept exactly as written.
        let (rest, p) = split(
            "host=h password='a  b' sslmode = verify-full sslrootcert='/x y/ca.pem' user=o\\'k",
        )
        .unwrap();
        assert_eq!(rest, "host=h password='a  b' user=o\\'k");
        assert_eq!(p.mode, Some(TlsMode::VerifyFull));
        assert_eq!(p.root_cert.as_deref(), Some("/x y/ca.pem"));
        let config = driver_config("host=h password='a  b' dbname=d").unwrap().0;
        assert_eq!(config.get_password(), Some("a  b".as_bytes()));
    }

    #[test]
    fn system_roots_need_the_host_name_checked() {
        let with = |mode: Option<TlsMode>, root: Option<&str>| TlsParams {
            mode,
            root_cert: root.map(str::to_string),
            ..TlsParams::default()
        };
        for weak in [TlsMode::Require, TlsMode::VerifyCa, TlsMode::Prefer] {
            assert!(matches!(
                connector(&with(Some(weak), Some("system"))),
                Err(TlsConfigError::WeakSystemRoots)
            ));
        }
        assert!(matches!(
            connector(&with(Some(TlsMode::VerifyCa), None)),
            Err(TlsConfigError::VerifyCaWithoutRoot)
        ));
        // sslrootcert=system alone means verify-full (when the machine has
        // roots at all).
        if let Ok((_, mode)) = connector(&with(None, Some("system"))) {
            assert_eq!(mode, SslMode::Require);
        }
        // An sslmode keel could not read is refused, not replaced.
        assert!(driver_config("host=h sslmode=require").is_ok());
        assert!(driver_config("postgres://u@h/db").is_ok());
        // Unix sockets ignore sslmode, as libpq does.
        let (config, _) = driver_config("host=/tmp sslmode=require").unwrap();
        assert_eq!(config.get_ssl_mode(), SslMode::Disable);
    }

    #[test]
    fn bad_tls_settings_are_named() {
        assert!(matches!(
            split("postgres://h/db?sslmode=sometimes"),
            Err(TlsConfigError::Mode(m)) if m == "sometimes"
        ));
        let params = TlsParams {
            mode: Some(TlsMode::VerifyFull),
            root_cert: Some("/nonexistent/keel-root.pem".into()),
            ..TlsParams::default()
        };
        let err = connector(&params).expect_err("a missing root file is refused");
        assert!(
            err.to_string()
                .contains("sslrootcert \"/nonexistent/keel-root.pem\""),
            "{err}"
        );
        let params = TlsParams {
            mode: Some(TlsMode::Require),
            cert: Some("/c.pem".into()),
            ..TlsParams::default()
        };
        assert!(matches!(
            connector(&params),
            Err(TlsConfigError::HalfClientCert("sslkey"))
        ));
        // `require` with a root file checks the chain, as libpq does.
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("root.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let params = TlsParams {
            mode: Some(TlsMode::Require),
            root_cert: Some(junk.display().to_string()),
            ..TlsParams::default()
        };
        let err = connector(&params).expect_err("junk roots are refused");
        assert!(err.to_string().contains("no certificate in it"), "{err}");
    }
}
