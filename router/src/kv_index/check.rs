//! The credit check: the router's credit for a request, held against the engine's own count of
//! the prompt tokens it served from its prefix cache (vLLM's
//! `usage.prompt_tokens_details.cached_tokens`, under `--enable-prompt-tokens-details`), per
//! engine (docs/design/kv-aware-placement.md, section 6.1).
//!
//! ```text
//!  observe(reported, credited, engine)
//!     over  = reported − engine   (> 0: blocks the engine's events said it held, it had not)
//!     under = engine − credited   (> 0: it had more than the router credited)
//!
//!  exact ──[SUSPECT_AFTER over-credited checks in a row]──► suspect
//!  suspect ──[AGREE_AFTER checks in a row not over-credited]──► exact
//!  any ──restart() (a new engine process, its entries dropped)──► exact, streaks at 0
//! ```
//!
//! Over-credit is measured on the part of the credit the engine's own events reported
//! (`reported`), not on placements it has not reported yet (`serving.kv_pending_s`): a request
//! sent while an earlier one with its prefix is still computing is credited with blocks the
//! engine stores a moment later, which is no fault of the index. Pure: no clock, no IO.

/// Over-credited checks in a row that make an engine `suspect`.
pub(crate) const SUSPECT_AFTER: u32 = 3;

/// Checks in a row without over-credit that make a `suspect` engine `exact` again.
pub(crate) const AGREE_AFTER: u32 = 3;

/// What one check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The reported credit was at most what the engine had, and the credit at least it.
    Agree,
    /// The engine had this many tokens fewer than its events said.
    Over(u64),
    /// The engine had this many tokens more than the router credited.
    Under(u64),
}

/// One engine's credit check (cumulative counters for the router's life, and the streaks
/// that decide `suspect`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CreditCheck {
    /// Requests checked.
    pub checked: u64,
    /// Checks that found over-credit.
    pub over_credited: u64,
    /// Tokens over-credited, summed.
    pub over_tokens: u64,
    /// Tokens under-credited, summed.
    pub under_tokens: u64,
    /// Whether the engine is `suspect` now: placed by load, its credit still computed and
    /// checked.
    pub suspect: bool,
    over_streak: u32,
    agree_streak: u32,
}

impl CreditCheck {
    /// One request placed on the engine: `reported` of its credit came from blocks the
    /// engine's events reported (the rest from placements not reported yet), `credited` in
    /// all, and the engine served `engine` tokens from its cache. Returns the verdict and
    /// whether the engine's `suspect` state changed.
    pub(crate) fn observe(&mut self, reported: u64, credited: u64, engine: u64) -> (Verdict, bool) {
        self.checked += 1;
        let was = self.suspect;
        let verdict = if reported > engine {
            Verdict::Over(reported - engine)
        } else if engine > credited {
            Verdict::Under(engine - credited)
        } else {
            Verdict::Agree
        };
        match verdict {
            Verdict::Over(t) => {
                self.over_credited += 1;
                self.over_tokens += t;
                self.over_streak = self.over_streak.saturating_add(1);
                self.agree_streak = 0;
                if self.over_streak >= SUSPECT_AFTER {
                    self.suspect = true;
                }
            }
            Verdict::Under(_) | Verdict::Agree => {
                if let Verdict::Under(t) = verdict {
                    self.under_tokens += t;
                }
                self.over_streak = 0;
                self.agree_streak = self.agree_streak.saturating_add(1);
                if self.agree_streak >= AGREE_AFTER {
                    self.suspect = false;
                }
            }
        }
        (verdict, was != self.suspect)
    }

    /// A new engine process (its entries dropped): nothing it did before says anything of the
    /// new index, so it is not `suspect` and both streaks start again. Counters are kept.
    pub(crate) fn restart(&mut self) {
        self.suspect = false;
        self.over_streak = 0;
        self.agree_streak = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Transition by transition: over-credit below the streak leaves the engine `exact`; the
    /// third in a row makes it `suspect`; agreement (or under-credit) resets the over streak;
    /// `AGREE_AFTER` checks without over-credit make it `exact` again; a restart clears it.
    #[test]
    fn over_credit_in_a_row_makes_an_engine_suspect_and_agreement_clears_it() {
        let mut c = CreditCheck::default();
        assert_eq!(c.observe(40, 40, 0), (Verdict::Over(40), false));
        assert_eq!(c.observe(40, 40, 0), (Verdict::Over(40), false));
        assert_eq!(c.observe(40, 40, 40), (Verdict::Agree, false));
        assert!(!c.suspect, "the streak was broken");
        assert_eq!(c.observe(40, 40, 36), (Verdict::Over(4), false));
        assert_eq!(c.observe(40, 40, 0), (Verdict::Over(40), false));
        assert_eq!(c.observe(40, 40, 0), (Verdict::Over(40), true));
        assert!(c.suspect);
        assert_eq!(c.observe(40, 40, 0), (Verdict::Over(40), false));
        assert_eq!(c.observe(0, 0, 16), (Verdict::Under(16), false));
        assert_eq!(c.observe(40, 40, 40), (Verdict::Agree, false));
        assert!(c.suspect, "two checks are not yet agreement");
        assert_eq!(c.observe(0, 0, 0), (Verdict::Agree, true));
        assert!(!c.suspect);
        assert_eq!(c.checked, 10);
        assert_eq!(c.over_credited, 6);
        assert_eq!(c.over_tokens, 40 * 5 + 4);
        assert_eq!(c.under_tokens, 16);
        for _ in 0..SUSPECT_AFTER {
            c.observe(8, 8, 0);
        }
        assert!(c.suspect);
        c.restart();
        assert!(!c.suspect);
        assert!(!c.observe(8, 8, 0).1, "the streak started again");
    }

    /// Credit from placements the engine has not reported yet is never over-credit: only the
    /// reported part is held against the engine's count, and the whole credit against
    /// under-credit.
    #[test]
    fn pending_credit_is_not_over_credit() {
        let mut c = CreditCheck::default();
        for _ in 0..SUSPECT_AFTER {
            assert_eq!(c.observe(0, 40, 0).0, Verdict::Agree);
        }
        assert!(!c.suspect);
        assert_eq!(c.observe(16, 40, 24).0, Verdict::Agree);
        assert_eq!(c.observe(16, 16, 24).0, Verdict::Under(8));
    }
}
