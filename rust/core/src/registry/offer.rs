//! The order a scheduler offers its requests to a step in: the core's ranking, so an engine that
//! picks the requests a step may take (under its own token and memory budgets) ranks them by the
//! same rules the core admits by, instead of keeping a copy of them.

use std::cmp::Reverse;

use super::Registry;
use crate::admission::{rank, Need};
use crate::error::{Error, Result};
use crate::limits::OVERDUE_AFTER;
use crate::policy::AdapterKey;

/// The rule a scheduler offers its requests to a step by ([`Registry::offer_order`]) and starts
/// the admitted ones by ([`crate::StepPlan::startable`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AdmissionOrder {
    /// Running requests first; then the waiting ones by what they cost (overdue, pinned adapters',
    /// those that cost no load, the rest), each rank in arrival order; and a waiting request
    /// deferred for device room holds back the later waiting ones that use an adapter. Requests
    /// start about in arrival order and keep running once started.
    #[default]
    Arrival,
    /// Overdue waiting requests first; then those that take no device room (the base model's,
    /// pinned adapters'); then every other request, running or waiting, by the tokens it has left
    /// to generate, most first (running before waiting on a tie, then the given order); no
    /// holding back. Under memory pressure a running request with few tokens left gives way to one
    /// with many, whose pages are then held for the whole batch's tail (longest remaining
    /// processing time first, the rule that shortens a batch's makespan); the age bound still
    /// admits every request in time.
    LongestRemaining,
}

impl AdmissionOrder {
    /// `"arrival"` or `"longest_remaining"`.
    ///
    /// Errors: [`Error::Spec`] naming any other value.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "arrival" => Ok(Self::Arrival),
            "longest_remaining" => Ok(Self::LongestRemaining),
            other => Err(Error::Spec(format!(
                "admission order must be \"arrival\" or \"longest_remaining\" (got {other:?})"
            ))),
        }
    }

    /// The name [`AdmissionOrder::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Self::Arrival => "arrival",
            Self::LongestRemaining => "longest_remaining",
        }
    }
}

/// What a request wants, for [`Registry::offer_order`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wants {
    /// The base model alone.
    Base,
    /// A registered adapter.
    Adapter(AdapterKey),
    /// An adapter name not registered (unloaded meanwhile, or not discovered yet).
    Unregistered,
}

/// One request a scheduler may offer a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// Its adapter.
    pub wants: Wants,
    /// `None` for a request already running (its sequence started); for a waiting one, how many
    /// rounds younger requests started ahead of it.
    pub overtaken: Option<u32>,
    /// The tokens it has left to generate (its limit less those generated; `u32::MAX` without a
    /// limit). Only [`AdmissionOrder::LongestRemaining`] reads it.
    pub remaining: u32,
}

impl Registry {
    /// The order to offer `requests` in, as indices, by `order` (see [`AdmissionOrder`]).
    /// [`AdmissionOrder::Arrival`]: running requests first, as given; then the waiting ones,
    /// ranked: overdue (overtaken in [`OVERDUE_AFTER`] rounds or more: the age bound admission
    /// keeps for adapters too), then those of pinned adapters, then those that cost no load (the
    /// base model's, an adapter's in a device slot), then the rest; each rank in the given
    /// (arrival) order. [`AdmissionOrder::LongestRemaining`]: overdue waiting requests, then those
    /// that take no device room (the base model's, pinned adapters'), then the rest by
    /// [`Offer::remaining`], most first, running before waiting on a tie. Changes nothing.
    pub fn offer_order(&self, requests: &[Offer], order: AdmissionOrder) -> Vec<u32> {
        let need = |offer: &Offer| match offer.wants {
            Wants::Base => Need::Free,
            Wants::Adapter(key) if self.get(key).protection.pinned => Need::Pinned,
            Wants::Adapter(key) if self.get(key).tenancy.slot.is_some() => Need::Free,
            Wants::Adapter(_) | Wants::Unregistered => Need::Slot,
        };
        let overdue = |offer: &Offer| offer.overtaken.is_some_and(|o| o >= OVERDUE_AFTER);
        let mut indices: Vec<u32> = (0..requests.len() as u32).collect();
        // Stable sorts: equal keys keep the given order.
        match order {
            AdmissionOrder::Arrival => {
                // Running requests before every waiting one; the waiting ones by the rank admission
                // shares with schedulers that keep their own slots (`crate::admission`).
                indices.sort_by_key(|&i| {
                    let offer = &requests[i as usize];
                    offer.overtaken.map_or(0, |_| 1 + rank(overdue(offer), need(offer)))
                });
            }
            AdmissionOrder::LongestRemaining => {
                indices.sort_by_key(|&i| {
                    let offer = &requests[i as usize];
                    let roomless = matches!(offer.wants, Wants::Base)
                        || matches!(offer.wants, Wants::Adapter(key) if self.get(key).protection.pinned);
                    let class = if overdue(offer) {
                        0
                    } else if roomless {
                        1
                    } else {
                        2
                    };
                    (class, Reverse(offer.remaining), offer.overtaken.is_some())
                });
            }
        }
        indices
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::testkit::*;
    use crate::registry::{StepMode, StepRequest};

    /// Three slots: a pinned, b in a slot after a step, c and d outside the device tier.
    fn pinned_a_and_b_in_a_slot() -> Registry {
        let mut reg = registry(3, None, "lru", &["a", "b", "c", "d"]);
        reg.pin("a").unwrap();
        let b = reg.lookup("b", false).unwrap();
        let (plan, ticket) = reg
            .begin_step(StepRequest::new(&[Some(b)], &[1], StepMode::ReadInStep))
            .unwrap()
            .begun()
            .unwrap();
        for i in 0..plan.loads.len() {
            reg.report_load(ticket, i, true).unwrap();
        }
        reg.finish_step(ticket).unwrap();
        reg
    }

    #[test]
    fn running_then_overdue_pinned_free_and_the_rest_each_in_arrival_order() {
        let reg = pinned_a_and_b_in_a_slot();
        let key = |n: &str| Wants::Adapter(reg.lookup(n, false).unwrap());
        let waiting = |wants, overtaken| Offer { wants, overtaken: Some(overtaken), remaining: 0 };
        let requests = [
            waiting(key("c"), 0),                                        // 0: rest
            waiting(Wants::Base, 0),                                     // 1: free
            Offer { wants: key("d"), overtaken: None, remaining: 0 },    // 2: running
            waiting(key("a"), 0),                                        // 3: pinned
            waiting(key("d"), OVERDUE_AFTER),                            // 4: overdue
            waiting(key("b"), 1),                                        // 5: free (in a slot)
            waiting(Wants::Unregistered, 0),                             // 6: rest
            waiting(key("c"), OVERDUE_AFTER - 1),                        // 7: rest, not overdue yet
            Offer { wants: Wants::Base, overtaken: None, remaining: 0 }, // 8: running
        ];
        assert_eq!(reg.offer_order(&requests, AdmissionOrder::Arrival), [2, 8, 4, 3, 1, 5, 0, 6, 7]);
        assert!(reg.offer_order(&[], AdmissionOrder::Arrival).is_empty());
    }

    #[test]
    fn longest_remaining_offers_overdue_then_roomless_then_most_tokens_left() {
        let reg = pinned_a_and_b_in_a_slot();
        let key = |n: &str| Wants::Adapter(reg.lookup(n, false).unwrap());
        let offer = |wants, overtaken, remaining| Offer { wants, overtaken, remaining };
        let requests = [
            offer(key("c"), Some(0), 5),                 // 0: rest, 5 left
            offer(Wants::Base, Some(0), 1),              // 1: no room, 1 left
            offer(key("d"), None, 3),                    // 2: running, 3 left
            offer(key("a"), Some(0), 2),                 // 3: pinned: no room
            offer(key("d"), Some(OVERDUE_AFTER), 1),     // 4: overdue
            offer(key("b"), Some(1), 9),                 // 5: in a slot, 9 left: by tokens all the same
            offer(Wants::Unregistered, Some(0), 3),      // 6: rest, 3 left, waiting: after 2
            offer(key("c"), None, 5),                    // 7: running, 5 left: before 0
            offer(Wants::Base, None, u32::MAX),          // 8: running, no room, no limit: first of them
            offer(key("c"), Some(OVERDUE_AFTER - 1), 4), // 9: not overdue yet
        ];
        assert_eq!(
            reg.offer_order(&requests, AdmissionOrder::LongestRemaining),
            [4, 8, 3, 1, 5, 7, 0, 9, 2, 6]
        );
        // Arrival order ignores the tokens left.
        assert_eq!(reg.offer_order(&requests, AdmissionOrder::Arrival), [2, 7, 8, 4, 3, 1, 5, 0, 6, 9]);
        assert!(reg.offer_order(&[], AdmissionOrder::LongestRemaining).is_empty());
    }

    #[test]
    fn admission_orders_parse_by_name_and_refuse_others() {
        for order in [AdmissionOrder::Arrival, AdmissionOrder::LongestRemaining] {
            assert_eq!(AdmissionOrder::parse(order.name()).unwrap(), order);
        }
        let err = AdmissionOrder::parse("shortest").unwrap_err();
        assert!(matches!(&err, crate::error::Error::Spec(m) if m.contains("\"shortest\"")), "{err}");
    }
}
