//! The model's engines and agents behind the real readmission checks ([`validate`] runs
//! against [`Fleet`], every attestation through an agent's fence), and the executor for
//! those checks' futures, which never pend.

use super::*;

/// The model's engines and agents behind the readmission checks: every engine answers
/// health, serves model `m`, and is attested through its agent under the router's epoch.
pub(super) struct Fleet<'a> {
    pub(super) model: &'a Narwhal,
    pub(super) world: Mutex<&'a mut World>,
    pub(super) router: usize,
    pub(super) epoch: u64,
    pub(super) stale: Mutex<bool>,
}

impl Fleet<'_> {
    fn identity(&self, iid: &str) -> Result<Identity, CheckError> {
        let mut w = self.world.lock().expect("no poison");
        let e = usize::from(index_of(iid));
        if let Err(highest) = self.model.admit(&mut w, e, self.router, self.epoch) {
            *self.stale.lock().expect("no poison") = true;
            return Err(CheckError::Agent {
                detail: format!("stale_epoch: highest {highest}"),
            });
        }
        let start = w.starts[e];
        Ok(Identity {
            key: format!("{iid}@{start}"),
            start: start as f64,
        })
    }
}

impl Checks for Fleet<'_> {
    async fn health(&self, _iid: &str) -> Result<(), CheckError> {
        Ok(())
    }
    async fn attest(&self, iid: &str) -> Result<Attested, CheckError> {
        Ok(Attested {
            identity: self.identity(iid)?,
            models: vec!["m".into()],
            fingerprint: "fp".into(),
        })
    }
    async fn generation(&self, iid: &str) -> Result<Identity, CheckError> {
        self.identity(iid)
    }
    async fn kv_produce(
        &self,
        iid: &str,
        _: &str,
    ) -> Result<(serde_json::Value, Identity), CheckError> {
        Ok((serde_json::json!({"from": iid}), self.identity(iid)?))
    }
    async fn kv_consume(
        &self,
        iid: &str,
        _: &str,
        _kv: serde_json::Value,
    ) -> Result<Identity, CheckError> {
        self.identity(iid)
    }
    async fn probe(
        &self,
        iid: &str,
        _: &str,
        _kv: Option<serde_json::Value>,
    ) -> Result<Identity, CheckError> {
        self.identity(iid)
    }
}

/// Runs a future that never pends (the model's checks answer at once).
pub(super) fn block_on<F: Future>(f: F) -> F::Output {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}
