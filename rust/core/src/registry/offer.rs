//! The order a scheduler offers its requests to a step in: the core's ranking, so an engine that
//! picks the requests a step may take (under its own token and memory budgets) ranks them by the
//! same rules the core admits by, instead of keeping a copy of them.

use super::Registry;
use crate::admission::{rank, Need};
use crate::limits::OVERDUE_AFTER;
use crate::policy::AdapterKey;

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
}

impl Registry {
    /// The order to offer `requests` in, as indices: running requests first, as given; then the
    /// waiting ones, ranked: overdue (overtaken in [`OVERDUE_AFTER`] rounds or more: the age bound
    /// admission keeps for adapters too), then those of pinned adapters, then those that cost no load
    /// (the base model's, an adapter's in a device slot), then the rest; each rank in the given
    /// (arrival) order. Changes nothing.
    pub fn offer_order(&self, requests: &[Offer]) -> Vec<u32> {
        // Running requests before every waiting one; the waiting ones by the rank admission shares
        // with schedulers that keep their own slots (`crate::admission`).
        let rank = |offer: &Offer| -> u8 {
            let Some(overtaken) = offer.overtaken else { return 0 };
            let need = match offer.wants {
                Wants::Base => Need::Free,
                Wants::Adapter(key) if self.get(key).protection.pinned => Need::Pinned,
                Wants::Adapter(key) if self.get(key).tenancy.slot.is_some() => Need::Free,
                Wants::Adapter(_) | Wants::Unregistered => Need::Slot,
            };
            1 + rank(overtaken >= OVERDUE_AFTER, need)
        };
        let mut order: Vec<u32> = (0..requests.len() as u32).collect();
        // Stable: equal ranks keep the given order.
        order.sort_by_key(|&i| rank(&requests[i as usize]));
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::testkit::*;
    use crate::registry::{StepMode, StepRequest};

    #[test]
    fn running_then_overdue_pinned_free_and_the_rest_each_in_arrival_order() {
        // Three slots: a pinned, b in a slot after a step, c and d outside the device tier.
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
        let key = |n: &str| Wants::Adapter(reg.lookup(n, false).unwrap());
        let waiting = |wants, overtaken| Offer { wants, overtaken: Some(overtaken) };
        let requests = [
            waiting(key("c"), 0),                          // 0: rest
            waiting(Wants::Base, 0),                       // 1: free
            Offer { wants: key("d"), overtaken: None },    // 2: running
            waiting(key("a"), 0),                          // 3: pinned
            waiting(key("d"), OVERDUE_AFTER),              // 4: overdue
            waiting(key("b"), 1),                          // 5: free (in a slot)
            waiting(Wants::Unregistered, 0),               // 6: rest
            waiting(key("c"), OVERDUE_AFTER - 1),          // 7: rest, not overdue yet
            Offer { wants: Wants::Base, overtaken: None }, // 8: running
        ];
        assert_eq!(reg.offer_order(&requests), [2, 8, 4, 3, 1, 5, 0, 6, 7]);
        assert!(reg.offer_order(&[]).is_empty());
    }
}
