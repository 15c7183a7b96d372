//! `--follow`: ranks that appear under the job's REF after the start (an
//! elastic restart's new workers, a rank started late) are attached as
//! they appear, each on a thread of its own for the slow part (markers,
//! eBPF object), and handed to the controller, which takes them in and
//! aligns the ranks again once no job window is in flight.
use std::{cell::Cell, collections::HashSet};

use super::*;
use crate::types::HostPid;

/// How often the REF is read again.
const POLL: Duration = Duration::from_millis(500);
/// How long a new rank may take to load its marker's module (it is found
/// as soon as it loads a framework, before the training loop starts).
const MARKER_WAIT: Duration = Duration::from_secs(120);

/// What the controller and `run` share with the follower.
#[derive(Clone)]
pub(super) struct FollowState {
    /// The REF is gone (its launcher exited): no rank will come any more.
    pub(super) gone: Rc<Cell<bool>>,
}

pub(super) struct Follower {
    args: AttachArgs,
    job_ref: JobRef,
    known: HashSet<HostPid>,
    collect: Vec<Builtin>,
    late_tx: mpsc::UnboundedSender<CtlRank>,
    limits: (Option<u64>, Option<Duration>),
    state: FollowState,
    handles: Rc<RefCell<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Follower {
    pub(super) fn new(
        args: AttachArgs,
        job_ref: JobRef,
        known: impl IntoIterator<Item = HostPid>,
        collect: Vec<Builtin>,
        late_tx: mpsc::UnboundedSender<CtlRank>,
        limits: (Option<u64>, Option<Duration>),
    ) -> Self {
        Self {
            args,
            job_ref,
            known: known.into_iter().collect(),
            collect,
            late_tx,
            limits,
            state: FollowState {
                gone: Rc::new(Cell::new(false)),
            },
            handles: Rc::new(RefCell::new(Vec::new())),
        }
    }

    pub(super) fn state(&self) -> FollowState {
        self.state.clone()
    }

    /// The session tasks of the ranks attached late (awaited by `run`).
    pub(super) fn handles(&self) -> Rc<RefCell<Vec<tokio::task::JoinHandle<()>>>> {
        Rc::clone(&self.handles)
    }

    pub(super) async fn run(mut self) {
        loop {
            tokio::time::sleep(POLL).await;
            if self.late_tx.is_closed() {
                return;
            }
            let members = match job::discover::discover(&self.job_ref) {
                Ok((m, _)) => m,
                // Between an elastic restart's old and new workers.
                Err(e) if e.is::<job::discover::NoRanksYet>() => continue,
                Err(e) => {
                    eprintln!("dynprof: job: {e:#}; no more ranks will be attached");
                    self.state.gone.set(true);
                    return;
                }
            };
            for m in members {
                if !self.known.insert(m.host_pid) {
                    continue;
                }
                self.attach(m).await;
            }
        }
    }

    async fn attach(&mut self, m: Member) {
        eprintln!(
            "dynprof: rank {}: PID {} appeared; attaching",
            m.rank, m.host_pid
        );
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (args, member, collect) = (self.args.clone(), m.clone(), self.collect.clone());
        let spawned = std::thread::Builder::new()
            .name("dynprof-rank".into())
            .spawn(move || {
                let _ = tx.send(resolve_rank(
                    &args,
                    &member,
                    MarkerWait::For(MARKER_WAIT),
                    &collect,
                ));
            });
        let resolved = match spawned {
            Ok(_) => rx
                .await
                .unwrap_or_else(|_| Err(anyhow::anyhow!("resolving panicked"))),
            Err(e) => Err(e.into()),
        };
        match resolved.and_then(|r| attach_rank(&self.args, &m, r, &self.collect)) {
            Ok(a) => {
                eprintln!(
                    "dynprof: rank {}: attached to PID {} (late)",
                    m.rank, m.host_pid
                );
                crate::sys::memory::trim_heap();
                let ctl = a.ctl();
                self.handles.borrow_mut().push(spawn_rank(a, self.limits));
                let _ = self.late_tx.send(ctl);
            }
            Err(e) => eprintln!(
                "dynprof: rank {}: cannot attach to PID {}: {e:#}",
                m.rank, m.host_pid
            ),
        }
    }
}
