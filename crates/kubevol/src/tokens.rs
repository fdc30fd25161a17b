//! Service account tokens for `serviceAccountToken` projected sources.
//!
//! A token comes from an issuer (in cluster mode, the API server's TokenRequest, bound to the
//! pod) and is kept until it needs refreshing: when 80 % of its lifetime has passed or after
//! 24 hours, whichever is first, as the kubelet's token manager. The projected volume is then
//! written again with a new token, without the pod doing anything. A token is never logged and
//! never part of an error, an event or the status.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::time::Instant;

/// What a token is asked for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TokenSpec {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's service account (`spec.serviceAccountName`, `default` when unset).
    pub service_account: String,
    /// The source's audience (none: the API server's own audiences).
    pub audience: Option<String>,
    /// The lifetime asked for, in seconds (the source's `expirationSeconds`, 1 h by default).
    pub expiration_seconds: i64,
    /// The pod the token is bound to: its name.
    pub pod_name: String,
    /// And its UID.
    pub pod_uid: String,
}

/// A token as issued.
#[derive(Clone)]
pub struct IssuedToken {
    /// The token.
    pub token: String,
    /// How long it is valid from now (what the issuer granted, which may differ from what was
    /// asked).
    pub valid_for: Duration,
}

impl std::fmt::Debug for IssuedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token itself.
        f.debug_struct("IssuedToken")
            .field("valid_for", &self.valid_for)
            .finish_non_exhaustive()
    }
}

/// Who issues tokens (the API server in cluster mode).
pub trait TokenIssuer: Send + Sync + 'static {
    /// A token for `spec`, or why not (never containing a token).
    fn issue(
        &self,
        spec: TokenSpec,
    ) -> crate::BoxFuture<Result<IssuedToken, crate::error::ApiError>>;
}

/// The service account of `pod`: `spec.serviceAccountName`, `default` when unset.
pub fn service_account(pod: &k8s_openapi::api::core::v1::Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".into())
}

impl TokenSpec {
    /// A token of `pod`'s service account bound to it, for `audience` (empty or none: the API
    /// server's own) and lifetime (1 h when unset), as projected sources and CSIDrivers'
    /// `tokenRequests` ask for them.
    pub fn for_pod(
        pod_ref: &kubevol_core::PodRef,
        pod: &k8s_openapi::api::core::v1::Pod,
        audience: Option<&str>,
        expiration_seconds: Option<i64>,
    ) -> Self {
        TokenSpec {
            namespace: pod_ref.namespace.to_string(),
            service_account: service_account(pod),
            audience: audience.filter(|a| !a.is_empty()).map(String::from),
            expiration_seconds: expiration_seconds.unwrap_or(3600),
            pod_name: pod_ref.name.to_string(),
            pod_uid: pod_ref.uid.to_string(),
        }
    }
}

/// The most a token is kept before it is refreshed, whatever its lifetime.
const MAX_KEEP: Duration = Duration::from_secs(24 * 3600);

/// When a token issued now, valid for `valid_for`, must be refreshed.
pub fn refresh_after(valid_for: Duration) -> Duration {
    valid_for.mul_f64(0.8).min(MAX_KEEP)
}

struct Cached {
    token: String,
    refresh_at: Instant,
    expires_at: Instant,
    expires: std::time::SystemTime,
}

/// A token handed out: the token, when it must be refreshed, and when it expires by the wall
/// clock (what a CSI driver is told with it).
#[derive(Clone)]
pub struct Granted {
    /// The token.
    pub token: String,
    /// When it is due for refreshing.
    pub refresh_at: Instant,
    /// When it expires.
    pub expires: std::time::SystemTime,
}

/// The tokens in use, by what they were asked for.
#[derive(Default)]
pub struct Tokens {
    issuer: RwLock<Option<Arc<dyn TokenIssuer>>>,
    cache: Mutex<HashMap<TokenSpec, Cached>>,
}

impl Tokens {
    /// Sets who issues tokens.
    pub fn set_issuer(&self, issuer: Arc<dyn TokenIssuer>) {
        *crate::sync::write(&self.issuer) = Some(issuer);
    }

    /// Whether tokens can be had at all.
    pub fn has_issuer(&self) -> bool {
        crate::sync::read(&self.issuer).is_some()
    }

    /// A token for `spec`, when it must be refreshed and when it expires: the kept one until it
    /// is due, a new one after. `None` when there is no issuer.
    pub async fn get(&self, spec: TokenSpec) -> Option<Result<Granted, crate::error::ApiError>> {
        let issuer = crate::sync::read(&self.issuer).clone()?;
        let now = Instant::now();
        let granted = |c: &Cached, refresh_at: Instant| Granted {
            token: c.token.clone(),
            refresh_at,
            expires: c.expires,
        };
        if let Some(c) = crate::sync::lock(&self.cache).get(&spec) {
            if now < c.refresh_at {
                return Some(Ok(granted(c, c.refresh_at)));
            }
        }
        let issued = match issuer.issue(spec.clone()).await {
            Ok(t) => t,
            Err(e) => {
                // A token that is due but still valid is better than none.
                let kept = crate::sync::lock(&self.cache)
                    .get(&spec)
                    .filter(|c| now < c.expires_at)
                    .map(|c| granted(c, now + Duration::from_secs(10)));
                return Some(kept.ok_or(e));
            }
        };
        let cached = Cached {
            token: issued.token,
            refresh_at: now + refresh_after(issued.valid_for),
            expires_at: now + issued.valid_for,
            expires: std::time::SystemTime::now() + issued.valid_for,
        };
        let out = granted(&cached, cached.refresh_at);
        let mut cache = crate::sync::lock(&self.cache);
        // Tokens of pods that are gone expire and are dropped here.
        cache.retain(|_, c| now < c.expires_at);
        cache.insert(spec, cached);
        Some(Ok(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_refreshed_at_80_percent_of_their_life_or_after_a_day() {
        assert_eq!(
            refresh_after(Duration::from_secs(3600)),
            Duration::from_secs(2880)
        );
        assert_eq!(
            refresh_after(Duration::from_secs(600)),
            Duration::from_secs(480)
        );
        assert_eq!(refresh_after(Duration::from_secs(7 * 24 * 3600)), MAX_KEEP);
    }

    struct Counting(Mutex<u32>, Duration);

    impl TokenIssuer for Counting {
        fn issue(
            &self,
            spec: TokenSpec,
        ) -> crate::BoxFuture<Result<IssuedToken, crate::error::ApiError>> {
            let mut n = self.0.lock().unwrap();
            *n += 1;
            let token = format!("token-{}-{n}", spec.pod_name);
            let valid_for = self.1;
            Box::pin(async move { Ok(IssuedToken { token, valid_for }) })
        }
    }

    fn spec() -> TokenSpec {
        TokenSpec {
            namespace: "ns".into(),
            service_account: "default".into(),
            audience: None,
            expiration_seconds: 3600,
            pod_name: "p".into(),
            pod_uid: "u".into(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_is_kept_until_it_is_due_then_issued_again() {
        let tokens = Tokens::default();
        assert!(tokens.get(spec()).await.is_none(), "no issuer: no token");
        tokens.set_issuer(Arc::new(Counting(Mutex::new(0), Duration::from_secs(3600))));
        let first = tokens.get(spec()).await.unwrap().unwrap();
        assert_eq!(first.token, "token-p-1");
        assert_eq!(first.refresh_at - Instant::now(), Duration::from_secs(2880));
        let left = first
            .expires
            .duration_since(std::time::SystemTime::now())
            .unwrap();
        assert!(
            left > Duration::from_secs(3590) && left <= Duration::from_secs(3600),
            "{left:?}"
        );
        tokio::time::advance(Duration::from_secs(2879)).await;
        assert_eq!(
            tokens.get(spec()).await.unwrap().unwrap().token,
            "token-p-1",
            "kept"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            tokens.get(spec()).await.unwrap().unwrap().token,
            "token-p-2",
            "refreshed"
        );
        let other = TokenSpec {
            audience: Some("vault".into()),
            ..spec()
        };
        assert_eq!(
            tokens.get(other).await.unwrap().unwrap().token,
            "token-p-3",
            "another audience, another token"
        );
    }
}
