//! Counting the RPCs in flight, so shutdown waits for the calls under way and not for idle
//! connections (a client's HTTP/2 connection stays open between calls; waiting for it to close
//! would hold every stop for the whole drain timeout).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

/// The number of requests being handled; a [`tower::Layer`] over the gRPC services.
#[derive(Clone, Debug, Default)]
pub struct InFlight {
    count: Arc<AtomicUsize>,
}

impl InFlight {
    /// Requests being handled now.
    pub fn now(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

impl<S> tower::Layer<S> for InFlight {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted { inner, count: self.count.clone() }
    }
}

/// A service whose calls are counted while their futures run.
#[derive(Clone, Debug)]
pub struct Counted<S> {
    inner: S,
    count: Arc<AtomicUsize>,
}

/// Decrements the count when the call's future completes or is dropped.
struct Guard(Arc<AtomicUsize>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<S, R> tower::Service<R> for Counted<S>
where
    S: tower::Service<R>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        self.count.fetch_add(1, Ordering::SeqCst);
        let guard = Guard(self.count.clone());
        let call = self.inner.call(req);
        Box::pin(async move {
            let _guard = guard;
            call.await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer, Service, ServiceExt};

    #[tokio::test]
    async fn a_call_counts_while_it_runs_and_not_after() {
        let inflight = InFlight::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let rx = Arc::new(tokio::sync::Mutex::new(Some(rx)));
        let svc = tower::service_fn(move |()| {
            let rx = rx.clone();
            async move {
                if let Some(rx) = rx.lock().await.take() {
                    let _ = rx.await;
                }
                Ok::<_, std::convert::Infallible>(())
            }
        });
        let mut svc = inflight.layer(svc);
        let call = svc.ready().await.unwrap().call(());
        assert_eq!(inflight.now(), 1);
        let task = tokio::spawn(call);
        tx.send(()).unwrap();
        task.await.unwrap().unwrap();
        assert_eq!(inflight.now(), 0);
        // A call dropped before it completes is not counted either.
        let dropped = svc.ready().await.unwrap().call(());
        assert_eq!(inflight.now(), 1);
        drop(dropped);
        assert_eq!(inflight.now(), 0);
    }
}
