//! The `stateright` [`Model`] of [`Narwhal`]: its initial states, actions, transitions and
//! the named properties (docs/design/model-check.md).

use super::*;

impl Model for Narwhal {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let router = |name: &str, primary: bool| Router {
            holder: format!("{name}:0"),
            alive: true,
            paused_until: 0,
            wall_jump: 0.0,
            lease: Lease::new(format!("{name}:0"), timing()),
            mode: Mode::Standby,
            machine: None,
            primary,
            renewing: false,
            renew_next: 0,
            standby_next: 0,
            tenure: 0,
            scope_open: false,
            claimed: 0,
            controlled: 0,
            lifecycle: Lifecycle::new(engines(), RestartPolicy::Individual),
            served: 0,
            seq: [0; 2],
            pending: None,
        };
        let mut w = World {
            t: 0,
            record: None,
            published: None,
            store_down_until: 0,
            lose_reply: false,
            routers: vec![router("r0", false), router("r1", true)],
            agents: vec![FenceState::default(); ENGINES.len()],
            starts: [100, 200],
            faults: self.bounds.faults,
            ops: self.bounds.ops,
            restarts: self.bounds.restarts,
            serves: self.bounds.serves,
            drops: self.bounds.drops,
            ghost: Ghost::default(),
        };
        // r0 starts as the primary: it claims epoch 1, publishes, checks the engines'
        // identities through their agents, and controls.
        let now = self.mono(&w);
        let wall = self.wall(&w, 0);
        let Claim::Write(rec) = w.routers[0].lease.claim(None, now, wall) else {
            unreachable!("a free lease")
        };
        w.routers[0].lease.granted(rec.epoch, now);
        w.routers[0].lease.wrote(&rec, now);
        w.record = Some(rec);
        {
            let r = &mut w.routers[0];
            r.mode = Mode::Active;
            r.claimed = 1;
            r.controlled = 1;
            r.renewing = true;
            r.renew_next = 1;
            for (k, iid) in ENGINES.iter().enumerate() {
                r.lifecycle.accept_process_start(iid, w.starts[k] as f64);
            }
        }
        for a in 0..ENGINES.len() {
            let _ = self.admit(&mut w, a, 0, 1);
        }
        self.publish(&mut w, 0, true).expect("the first publish");
        // r1 is a warm standby of it.
        self.enter_standby(&mut w, 1, None);
        vec![State {
            net: Network::new_unordered_nonduplicating([]),
            w,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let w = &s.w;
        let b = &self.bounds;
        let mut due = Vec::new();
        for i in 0..ROUTERS {
            due.extend(self.due(w, i));
        }
        // A message to a running receiver is delivered or dropped within `delay` ticks.
        let overdue = s.net.iter_deliverable().any(|env| {
            let sent = match env.msg {
                Msg::Capture { sent, .. } | Msg::Captured { sent, .. } => *sent,
            };
            let to = usize::from(env.dst);
            let waits = to < ROUTERS && w.routers[to].alive && !self.running(w, to);
            !waits && sent + b.delay <= w.t
        });
        let quiet = due.is_empty() && !overdue;
        actions.extend(due);
        if w.t < b.end() && quiet {
            actions.push(Action::Tick);
        }
        for env in s.net.iter_deliverable() {
            let to_router = usize::from(env.dst) < ROUTERS;
            if !to_router
                || self.running(w, usize::from(env.dst))
                || !w.routers[usize::from(env.dst)].alive
            {
                actions.push(Action::Deliver(env.to_cloned_msg()));
            }
            if w.drops > 0 {
                actions.push(Action::Drop(env.to_cloned_msg()));
            }
        }
        if w.t >= b.end() {
            return;
        }
        for i in 0..ROUTERS {
            if !self.running(w, i) || !self.controls(w, i) {
                continue;
            }
            if w.ops > 0 && w.t <= self.bounds.op_until && w.routers[i].pending.is_none() {
                // Requests the lifecycle core would refuse at once change nothing: only
                // those it may accept are tried (the core still decides).
                let lc = &w.routers[i].lifecycle;
                let held = lc.held();
                let wave = !lc.wave_id().is_empty();
                // The operator works on d0 (p0 is its live peer; a wave takes both).
                for (e, iid) in ENGINES.iter().enumerate().skip(1) {
                    let e = e as u8;
                    if held.is_empty() {
                        actions.push(Action::Operate(i, Op::Drain(e)));
                    } else if held.contains(*iid) && !wave {
                        actions.push(Action::Operate(i, Op::Readmit(e)));
                        actions.push(Action::Operate(i, Op::Cancel(e)));
                    }
                }
                if held.is_empty() {
                    actions.push(Action::Operate(i, Op::Wave));
                } else if wave {
                    actions.push(Action::Operate(i, Op::WaveReadmit));
                }
            }
            if w.serves > 0 {
                actions.push(Action::Serve(i));
            }
            // A read showing what was shown before changes nothing.
            if w.routers[i].served != w.ghost.read_max {
                actions.push(Action::Read(i));
            }
        }
        if w.restarts > 0 && w.t <= b.op_until + 1 {
            for e in 0..ENGINES.len() as u8 {
                actions.push(Action::Restart(e));
            }
        }
        if w.faults > 0 && w.t <= b.fault_until {
            let living = w.routers.iter().filter(|r| r.alive).count();
            for i in 0..ROUTERS {
                if !self.running(w, i) {
                    continue;
                }
                if living > 1 {
                    actions.push(Action::Kill(i));
                }
                actions.push(Action::Pause(i));
                if w.routers[i].wall_jump == 0.0 {
                    actions.push(Action::Jump(i));
                }
            }
            if self.store_up(w) {
                actions.push(Action::StoreDown);
                if !w.lose_reply {
                    actions.push(Action::LoseReply);
                }
            }
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        NET.with(|q| q.borrow_mut().clear());
        let w = &mut n.w;
        match action {
            Action::Tick => w.t += 1,
            Action::Renew(i) => self.renew(w, i),
            Action::Standby(i) => self.standby_tick(w, i),
            Action::Validated(i) => {
                let Mode::Validating { epoch, .. } = w.routers[i].mode else {
                    return None;
                };
                self.validated(w, i, epoch);
            }
            Action::Supervise(i) => self.supervise(w, i),
            Action::Ack(i) => self.ack(w, i),
            Action::Operate(i, op) => {
                w.ops -= 1;
                self.operate(w, i, op);
            }
            Action::Serve(i) => {
                w.serves -= 1;
                w.routers[i].served += 1;
            }
            Action::Read(i) => {
                let shown = w.routers[i].served;
                if self.publish(w, i, false).is_ok() {
                    if shown < w.ghost.read_max {
                        w.ghost.backwards = true;
                    }
                    w.ghost.read_max = w.ghost.read_max.max(shown);
                }
            }
            Action::Deliver(env) => {
                remove(&mut n.net, &env);
                self.deliver(&mut n, &env);
            }
            Action::Drop(env) => {
                remove(&mut n.net, &env);
                n.w.drops -= 1;
            }
            Action::Kill(i) => {
                w.faults -= 1;
                w.routers[i].alive = false;
            }
            Action::Pause(i) => {
                w.faults -= 1;
                w.routers[i].paused_until = w.t + PAUSE_TICKS;
            }
            Action::StoreDown => {
                w.faults -= 1;
                w.store_down_until = w.t + STORE_DOWN_TICKS;
            }
            Action::LoseReply => {
                w.faults -= 1;
                w.lose_reply = true;
            }
            Action::Jump(i) => {
                w.faults -= 1;
                w.routers[i].wall_jump = JUMP_S;
            }
            Action::Restart(e) => {
                w.restarts -= 1;
                w.starts[usize::from(e)] += 1;
            }
        }
        let sent: Vec<Envelope<Msg>> = NET.with(|q| std::mem::take(&mut *q.borrow_mut()));
        if !sent.is_empty()
            && let Network::UnorderedNonDuplicating(m) = &mut n.net
        {
            for env in sent {
                *m.entry(env).or_insert(0) += 1;
            }
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("one controller at a time", |m: &Narwhal, s: &State| {
                (0..ROUTERS).filter(|i| m.controls(&s.w, *i)).count() <= 1
            }),
            Property::always(
                "agents act only for the live epoch",
                |_: &Narwhal, s: &State| !s.w.ghost.acting,
            ),
            Property::always(
                "an agent never accepts an older epoch",
                |_: &Narwhal, s: &State| !s.w.ghost.older_epoch,
            ),
            Property::always(
                "an acknowledged action is never lost",
                |m: &Narwhal, s: &State| acked_kept(m, &s.w),
            ),
            Property::always(
                "readmission only after the checks on a newer process",
                |_: &Narwhal, s: &State| !s.w.ghost.readmission,
            ),
            Property::always("totals never go backwards", |_: &Narwhal, s: &State| {
                !s.w.ghost.backwards
            }),
            Property::always(
                "some router controls the fleet once faults stop",
                |m: &Narwhal, s: &State| {
                    let w = &s.w;
                    let quiet = (0..ROUTERS).all(|i| m.due(w, i).is_empty());
                    w.t < m.bounds.end() || !quiet || m.someone_controls(w)
                },
            ),
            Property::sometimes("a takeover happens", |m: &Narwhal, s: &State| {
                (0..ROUTERS).any(|i| m.controls(&s.w, i) && m.held(&s.w, i) > 1)
            }),
            Property::sometimes("a readmission is acknowledged", |_: &Narwhal, s: &State| {
                s.w.ghost
                    .acked
                    .iter()
                    .any(|a| matches!(a, Some((n, false)) if *n >= 2))
            }),
        ]
    }
}

/// Whoever controls holds every acknowledged action: the engine's action count is at least
/// the acknowledged one, and when equal the engine is held exactly as acknowledged.
fn acked_kept(m: &Narwhal, w: &World) -> bool {
    !w.ghost.unpublished_takeover
        && (0..ROUTERS).filter(|i| m.controls(w, *i)).all(|i| {
            let r = &w.routers[i];
            w.ghost.acked.iter().enumerate().all(|(e, a)| match a {
                None => true,
                Some((n, held)) => {
                    r.seq[e] > *n
                        || (r.seq[e] == *n && r.lifecycle.held().contains(ENGINES[e]) == *held)
                }
            })
        })
}

fn remove(net: &mut Network<Msg>, env: &Envelope<Msg>) {
    if let Network::UnorderedNonDuplicating(m) = net
        && let Some(c) = m.get_mut(env)
    {
        *c -= 1;
        if *c == 0 {
            m.remove(env);
        }
    }
}
