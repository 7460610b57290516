// Goal: `Store::list` finds exactly the runs a filter matches, through the
// index the commits write, page by page, on every store; the index follows
// starts, closes, upserts and removals in the commit that makes them.
// Method: a store of 80 runs (three types, instances with several runs,
// open and closed in every way, search attributes of every kind, upserted
// and removed later) built from a fixed seed; 400 random filters, each
// listed whole and in random page sizes, compared with every run record
// scanned directly and tested against the filter (an oracle that does not
// use the index); `verify` (which rebuilds the index from the events) clean.
// The same store checks the read that replay uses for many runs at once
// (`Store::for_each_history`, `KvRead::scan_prefixes`: one cursor, seeks
// skipped where runs follow each other) against each run read alone, for
// runs in key order, shuffled, repeated and absent, and visitors that stop
// early.

use crate::common::*;
use keel_storage::keys::Cf;
use keel_storage::search::{self, Field, Op};
use keel_storage::{
    codec, EventKind, ListError, PageToken, Payload, RunFilter, RunId, RunMeta, RunStatus,
    SearchValue, Seq, Store, Timestamp,
};

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

const TYPES: [&str; 3] = ["checkout", "refund", "checkout-extra"];
const CUSTOMERS: [&str; 4] = ["c-0", "c-1", "c-2", "c\u{0}3"];
const T0: u64 = 1_800_000_000_000;

fn attrs(pairs: &[(&str, SearchValue)]) -> EventKind {
    EventKind::SearchAttributesUpserted {
        attributes: pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_payload()))
            .collect(),
    }
}

fn value(rng: &mut Rng, name: &str) -> SearchValue {
    match name {
        "customer" => SearchValue::from(*rng.pick(&CUSTOMERS)),
        "amount" => SearchValue::Int(rng.below(200) as i64 - 50),
        "ratio" => SearchValue::Double((rng.below(100) as f64) / 10.0 - 2.5),
        "vip" => SearchValue::Bool(rng.below(2) == 0),
        _ => SearchValue::Time(Timestamp(T0 + rng.below(100_000))),
    }
}

const NAMES: [&str; 5] = ["customer", "amount", "ratio", "vip", "due"];

/// Builds the runs; returns nothing: the oracle reads the run records.
fn populate(store: &dyn Store, rng: &mut Rng) {
    let mut last_of_instance: Vec<Option<RunId>> = vec![None; 20];
    for n in 0..80u64 {
        let run = run_id(n + 1);
        let mut instance_no = rng.below(20) as usize;
        let busy = last_of_instance[instance_no]
            .and_then(|r| store.run_meta(r).unwrap())
            .is_some_and(|m| !m.status.is_closed());
        if busy {
            // An instance runs one run at a time: take a fresh one.
            instance_no = last_of_instance.len();
            last_of_instance.push(None);
        }
        let instance = format!("i-{instance_no}");
        let workflow_type = *rng.pick(&TYPES);
        // Start times collide now and then: the index orders by run id then.
        let at = T0 + rng.below(40) * 1_000;
        let mut b = RunBuilder::new(run, at);
        let mut start = match last_of_instance[instance_no] {
            Some(prev) => started_after(run, &instance, workflow_type, prev),
            None => started(run, &instance, workflow_type),
        };
        if let EventKind::WorkflowStarted(start) = &mut start {
            let keel_storage::WorkflowStart {
                search_attributes, ..
            } = &mut **start;
            if rng.below(2) == 0 {
                let name = *rng.pick(&NAMES);
                search_attributes.push((name.to_string(), value(rng, name).to_payload()));
            }
        }
        let keep_open = rng.below(3) == 0;
        b.commit(store, vec![start]).unwrap();
        for _ in 0..rng.below(3) {
            let pairs: Vec<(&str, SearchValue)> = (0..1 + rng.below(2))
                .map(|_| {
                    let name = *rng.pick(&NAMES);
                    (name, value(rng, name))
                })
                .collect();
            b.commit(store, vec![attrs(&pairs)]).unwrap();
        }
        if rng.below(4) == 0 {
            let name = rng.pick(&NAMES).to_string();
            let removal = EventKind::SearchAttributesUpserted {
                attributes: vec![(name, Payload::default())],
            };
            b.commit(store, vec![removal]).unwrap();
        }
        let close = closing(rng.below(3));
        if keep_open {
            last_of_instance[instance_no] = Some(run);
            continue;
        }
        b.at += rng.below(50_000);
        b.commit(store, vec![close]).unwrap();
        last_of_instance[instance_no] = Some(run);
    }
}

/// A run's closing event, one of three ways: 0 completed, 1 failed,
/// otherwise terminated.
fn closing(way: u64) -> EventKind {
    match way {
        0 => workflow_completed(),
        1 => EventKind::WorkflowFailed {
            failure: keel_storage::Failure::new(
                keel_storage::FailureKind::Application,
                "no",
                false,
            ),
        },
        _ => EventKind::WorkflowTerminated {
            reason: "ops".into(),
            command_id: None,
        },
    }
}

/// Every run record, read without the index.
fn all_runs(store: &dyn Store) -> Vec<RunMeta> {
    let mut out = Vec::new();
    store
        .view()
        .scan(Cf::Runs, &[], &[], &mut |_, v| {
            out.push(codec::decode(codec::RecordKind::Run, v).unwrap());
            true
        })
        .unwrap();
    out
}

fn random_filter(rng: &mut Rng) -> RunFilter {
    let mut f = RunFilter::all();
    let ops = [Op::Eq, Op::Ne, Op::Lt, Op::Le, Op::Gt, Op::Ge];
    for _ in 0..rng.below(4) {
        let time = Timestamp(T0 + rng.below(100_000));
        f = match rng.below(7) {
            0 => {
                let op = *rng.pick(&[Op::Eq, Op::Eq, Op::Ne]);
                f.and(Field::Status, op, rng.pick(&RunStatus::ALL).name())
            }
            1 => {
                let op = *rng.pick(&[Op::Eq, Op::Eq, Op::Ne]);
                f.and(Field::WorkflowType, op, *rng.pick(&TYPES))
            }
            2 => f.instance(&format!("i-{}", rng.below(20))),
            3 => f.and(Field::StartTime, *rng.pick(&ops), time),
            4 => f.and(Field::CloseTime, *rng.pick(&ops), time),
            _ => {
                let name = *rng.pick(&NAMES);
                let op = if name == "vip" {
                    *rng.pick(&[Op::Eq, Op::Ne])
                } else {
                    *rng.pick(&ops)
                };
                f.and(Field::Attribute(name.into()), op, value(rng, name))
            }
        };
    }
    f
}

fn ids(runs: &[RunMeta]) -> Vec<RunId> {
    runs.iter().map(|m| m.run_id).collect()
}

/// The runs `filter` lists, read page by page, `size` at most each.
fn in_pages(store: &dyn Store, filter: &RunFilter, size: usize) -> Vec<RunId> {
    let mut paged = Vec::new();
    let mut after: Option<PageToken> = None;
    loop {
        let page = store.list(filter, size, after.as_ref()).unwrap();
        assert!(page.runs.len() <= size);
        paged.extend(ids(&page.runs));
        match page.next {
            Some(t) => after = Some(t),
            None => return paged,
        }
    }
}

#[test]
fn many_histories_read_as_each_alone_on_every_store() {
    for_each_store(|store| {
        let mut rng = Rng(0x5eed_4157);
        populate(store, &mut rng);
        let mut known: Vec<RunId> = all_runs(store).iter().map(|m| m.run_id).collect();
        known.sort();
        let absent = [
            RunId::from_u64_pair(0, 1),
            RunId::from_u64_pair(u64::MAX, 7),
        ];
        for round in 0..60 {
            let runs: Vec<RunId> = match round % 4 {
                // Key order: every run follows the one before it.
                0 => known.clone(),
                // Key order with gaps, absent runs and repeats.
                1 => {
                    let mut runs = vec![absent[0]];
                    for run in &known {
                        for _ in 0..rng.below(3).saturating_sub(rng.below(2)) {
                            runs.push(*run);
                        }
                    }
                    runs.push(absent[1]);
                    runs
                }
                // Any order, absent runs among them.
                _ => (0..40)
                    .map(|_| match rng.below(8) {
                        0 => *rng.pick(&absent),
                        _ => *rng.pick(&known),
                    })
                    .collect(),
            };
            let mut seen = 0;
            store.for_each_history(&runs, &mut |i, read| {
                assert_eq!(i, seen, "round {round}: each run once, in order");
                seen += 1;
                let alone = store.history(runs[i]).unwrap();
                assert!(read.failure.is_none(), "round {round}: {:?}", read.failure);
                assert_eq!(read.events, alone, "round {round}: run {i} {}", runs[i]);
            });
            assert_eq!(seen, runs.len(), "round {round}");

            // The cursor after a visitor that stopped early: each prefix
            // still yields exactly its own first keys.
            let prefixes: Vec<Vec<u8>> = runs.iter().map(|r| r.as_bytes().to_vec()).collect();
            let limits: Vec<usize> = runs.iter().map(|_| rng.below(4) as usize).collect();
            let mut got: Vec<Vec<Vec<u8>>> = vec![Vec::new(); runs.len()];
            store
                .view()
                .scan_prefixes(Cf::Events, &prefixes, &mut |i, item| {
                    let (k, _) = item.unwrap();
                    got[i].push(k.to_vec());
                    got[i].len() < limits[i]
                });
            for (i, prefix) in prefixes.iter().enumerate() {
                let mut alone = Vec::new();
                store
                    .view()
                    .scan(Cf::Events, prefix, prefix, &mut |k, _| {
                        alone.push(k.to_vec());
                        alone.len() < limits[i]
                    })
                    .unwrap();
                assert_eq!(
                    got[i], alone,
                    "round {round}: prefix {i} stopped at {}",
                    limits[i]
                );
            }
        }
    });
}

#[test]
fn list_matches_an_oracle_on_every_store() {
    for_each_store(|store| {
        let mut rng = Rng(0x5eed_1157);
        populate(store, &mut rng);
        assert!(store.verify().unwrap().ok, "{:?}", store.verify().unwrap());
        let everything = all_runs(store);
        assert_eq!(everything.len(), 80);
        let mut nonempty = 0;
        for round in 0..400 {
            let filter = random_filter(&mut rng);
            let plan = search::plan(&filter);
            let whole = store.list(&filter, 1000, None).unwrap();
            assert!(whole.next.is_none(), "{filter}: one page holds all");
            let mut got = ids(&whole.runs);
            let mut want: Vec<RunId> = everything
                .iter()
                .filter(|m| filter.matches(m))
                .map(|m| m.run_id)
                .collect();
            // Newest first (ties by run id): by close time in the close-time
            // index, by start time in the others but a range of attribute
            // values, which orders by value.
            let by_close = plan.index == "close time";
            let key = |m: &RunMeta| {
                let t = match by_close {
                    true => m.closed_at.unwrap_or_default(),
                    false => m.started_at,
                };
                (std::cmp::Reverse(t), m.run_id)
            };
            if plan.index != "attribute range" {
                let mut sorted = whole.runs.clone();
                sorted.sort_by_key(key);
                assert_eq!(ids(&sorted), got, "{filter}: order");
            }
            got.sort();
            want.sort();
            assert_eq!(got, want, "round {round}: {filter} (index {})", plan.index);
            nonempty += usize::from(!want.is_empty());
            // Pages of a random size walk the same runs in the same order.
            let size = 1 + rng.below(7) as usize;
            let paged = in_pages(store, &filter, size);
            assert_eq!(paged, ids(&whole.runs), "{filter}: pages of {size}");
        }
        assert!(nonempty > 100, "the filters find something: {nonempty}");
        // `runs` honours its limit; a token from another filter is refused.
        let all = RunFilter::all();
        assert_eq!(store.runs(&all.clone().limit(7)).unwrap().len(), 7);
        let page = store.list(&all, 3, None).unwrap();
        let other = RunFilter::all().status(RunStatus::Running);
        let err = store.list(&other, 3, page.next.as_ref()).unwrap_err();
        assert!(matches!(err, ListError::BadToken(_)), "{err}");
        let err = store
            .list(&all, 3, Some(&PageToken("zz".into())))
            .unwrap_err();
        assert!(matches!(err, ListError::BadToken(_)), "{err}");
    });
}

#[test]
fn the_index_moves_in_the_commit_that_moves_the_run() {
    // Goal: a value is found by its new value, not its old one, right after
    // the commit that upserts it; a close moves the status; a removal
    // drops the entry. Method: one run, listed after each commit.
    for_each_store(|store| {
        let mut b = RunBuilder::new(run_id(1), T0);
        let mut start = started(b.run, "order-1", "checkout");
        if let EventKind::WorkflowStarted(start) = &mut start {
            let keel_storage::WorkflowStart {
                search_attributes, ..
            } = &mut **start;
            search_attributes.push(("customer".into(), SearchValue::from("c-42").to_payload()));
        }
        b.commit(store, vec![start]).unwrap();
        let found = |f: RunFilter| ids(&store.list(&f, 10, None).unwrap().runs);
        let by = |name: &str, v: SearchValue| RunFilter::all().attribute(name, v);
        assert_eq!(found(by("customer", "c-42".into())), vec![b.run]);
        assert_eq!(
            found(RunFilter::parse(r#"customer = "c-42" and status = running"#).unwrap()),
            vec![b.run]
        );
        b.commit(store, vec![attrs(&[("customer", "c-43".into())])])
            .unwrap();
        assert!(found(by("customer", "c-42".into())).is_empty());
        assert_eq!(found(by("customer", "c-43".into())), vec![b.run]);
        b.commit(
            store,
            vec![EventKind::SearchAttributesUpserted {
                attributes: vec![("customer".into(), Payload::default())],
            }],
        )
        .unwrap();
        assert!(found(by("customer", "c-43".into())).is_empty());
        b.commit(store, vec![workflow_completed()]).unwrap();
        let running = RunFilter::all().status(RunStatus::Running);
        assert!(found(running).is_empty());
        assert_eq!(
            found(RunFilter::all().status(RunStatus::Completed)),
            vec![b.run]
        );
        assert_eq!(
            found(RunFilter::all().closed_after(Timestamp(T0))),
            vec![b.run]
        );
        // A bad value in a commit is refused whole, naming the run.
        let mut c = RunBuilder::new(run_id(2), T0);
        c.commit(store, vec![started(c.run, "order-2", "checkout")])
            .unwrap();
        let before = dump(store);
        let err = c
            .commit(store, vec![attrs(&[("status", "x".into())])])
            .unwrap_err();
        assert!(matches!(err, keel_storage::Error::Metadata { .. }), "{err}");
        assert_eq!(dump(store), before);
        assert!(store.verify().unwrap().ok);
    });
}

// Goal: `count_by_status` counts the index's runs of each status exactly,
// and stops at its limit (a count at the limit reads "at least").
// Method: the same 80 runs; counts compared with the run records scanned
// directly, then again with a limit below the largest count.
#[test]
fn counts_by_status_match_the_run_records_up_to_the_limit() {
    for_each_store(|store| {
        let mut rng = Rng(0x5eed_1157);
        populate(store, &mut rng);
        let everything = all_runs(store);
        let counted = store.count_by_status(1000).unwrap();
        assert_eq!(counted.len(), RunStatus::ALL.len());
        for (status, n) in &counted {
            let want = everything.iter().filter(|m| m.status == *status).count();
            assert_eq!(*n, want, "{status:?}");
        }
        assert_eq!(counted.iter().map(|(_, n)| n).sum::<usize>(), 80);
        let most = counted.iter().map(|(_, n)| *n).max().unwrap();
        assert!(most > 3, "{counted:?}");
        for (status, n) in store.count_by_status(3).unwrap() {
            let want = everything.iter().filter(|m| m.status == status).count();
            assert_eq!(n, want.min(3), "{status:?}");
        }
    });
}

#[test]
fn get_many_answers_each_key_as_get_does_on_every_store() {
    // Goal: the batched read a list page uses to fetch its run records
    // answers, key by key in the order asked, exactly what `get` answers:
    // absent keys as `None`, a repeated key twice, no keys as nothing.
    // Method: three runs committed on every store; a mixed, unsorted key
    // list with absent and repeated keys compared with one `get` per key.
    for_each_store(|store| {
        for n in [3, 1, 2] {
            let run = run_id(n);
            RunBuilder::new(run, T0)
                .commit(store, vec![started(run, &format!("i-{n}"), "checkout")])
                .expect("start");
        }
        let keys: Vec<Vec<u8>> = [2, 9, 1, 3, 2, 7]
            .iter()
            .map(|n| keel_storage::keys::run_key(run_id(*n)))
            .collect();
        let view = store.view();
        let many = view.get_many(Cf::Runs, &keys).expect("get_many");
        let one: Vec<Option<Vec<u8>>> = keys
            .iter()
            .map(|k| view.get(Cf::Runs, k).expect("get"))
            .collect();
        assert_eq!(many, one);
        assert_eq!(many.iter().filter(|v| v.is_some()).count(), 4);
        assert!(view.get_many(Cf::Runs, &[]).expect("empty").is_empty());
    });
}

#[test]
fn runs_of_a_type_and_every_run_merge_the_status_indexes_in_start_order() {
    // Goal: a type alone, and no condition at all, are listed by reading
    // the status indexes across every status (one scan per status, merged
    // by start time and run id), and the merge is right when a status
    // holds more runs than one chunk of a scan reads: every page in order,
    // none lost or repeated, whatever the page size. Method: 500 runs of
    // two types over the same span of start times, most left open (more
    // than the largest chunk, 256 entries) and the rest closed three ways
    // (more than the smallest, 32), start times colliding often; each list
    // compared with the run records sorted newest first, ties by run id.
    for_each_store(|store| {
        let mut rng = Rng(0x00de_7a11);
        for n in 0..500u64 {
            let run = run_id(1_000 + n);
            let workflow_type = TYPES[(n % 2) as usize];
            let mut b = RunBuilder::new(run, T0 + rng.below(150) * 1_000);
            b.commit(store, vec![started(run, &format!("m-{n}"), workflow_type)])
                .unwrap();
            let way = rng.below(8);
            if way > 2 {
                continue;
            }
            let close = closing(way);
            b.commit(store, vec![close]).unwrap();
        }
        let everything = all_runs(store);
        assert_eq!(everything.len(), 500);
        let holds = |status| everything.iter().filter(|m| m.status == status).count();
        assert!(
            holds(RunStatus::Running) > 256,
            "{}",
            holds(RunStatus::Running)
        );
        assert!(
            holds(RunStatus::Completed) > 32,
            "{}",
            holds(RunStatus::Completed)
        );
        let newest_first = |filter: &RunFilter| {
            let mut want: Vec<&RunMeta> = everything.iter().filter(|m| filter.matches(m)).collect();
            want.sort_by_key(|m| (std::cmp::Reverse(m.started_at), m.run_id));
            want.into_iter().map(|m| m.run_id).collect::<Vec<_>>()
        };
        let filters = [
            RunFilter::all(),
            RunFilter::all().workflow_type(TYPES[1]),
            RunFilter::all().workflow_type("nobody's type"),
        ];
        for filter in filters {
            let plan = search::plan(&filter);
            assert!(plan.across_statuses, "{filter}: {}", plan.index);
            let want = newest_first(&filter);
            for size in [1, 5, 33, 1000] {
                let paged = in_pages(store, &filter, size);
                assert_eq!(paged, want, "{filter}: pages of {size}");
            }
        }
        // A token of one merged list does not resume another's, nor does
        // a status list's token (its key keeps the status byte) resume the
        // list of every run.
        let page = store.list(&RunFilter::all(), 3, None).unwrap();
        let other = RunFilter::all().workflow_type(TYPES[0]);
        let err = store.list(&other, 3, page.next.as_ref()).unwrap_err();
        assert!(matches!(err, ListError::BadToken(_)), "{err}");
        let running = RunFilter::all().status(RunStatus::Running);
        let page = store.list(&running, 3, None).unwrap();
        let err = store
            .list(&RunFilter::all(), 3, page.next.as_ref())
            .unwrap_err();
        assert!(matches!(err, ListError::BadToken(_)), "{err}");
    });
}

/// When a [`Closing`] view closes the next of its open runs.
#[derive(Clone, Copy)]
enum CloseAt {
    /// Right after each scan of the index by status (of the running runs'
    /// keys only, if `running_only`): commits landing between the scans a
    /// list across statuses makes.
    StatusScans { running_only: bool },
    /// Just before a read of a run's last event: a close landing between
    /// a reader's read of a run's record and the catching up of it.
    LastEvent,
}

/// A store's view that closes the next of `open` at `at`, and otherwise
/// reads as its store does (open runs' records caught up where they lag).
struct Closing<'a> {
    store: &'a dyn Store,
    open: std::cell::RefCell<Vec<RunBuilder>>,
    at: CloseAt,
}

impl Closing<'_> {
    fn close_next(&self) {
        if let Some(mut run) = self.open.borrow_mut().pop() {
            run.commit(self.store, vec![workflow_completed()]).unwrap();
        }
    }
}

impl keel_storage::kv::KvRead for Closing<'_> {
    fn get(&self, cf: Cf, key: &[u8]) -> keel_storage::Result<Option<Vec<u8>>> {
        self.store.view().get(cf, key)
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> keel_storage::Result<()> {
        let scanned = self.store.view().scan(cf, prefix, from, visit);
        if let CloseAt::StatusScans { running_only } = self.at {
            let by_status = prefix.first().is_some_and(|b| matches!(b, b'S' | b'X'));
            let running = prefix.get(1) == Some(&RunStatus::Running.code());
            if cf == Cf::Index && by_status && (running || !running_only) {
                self.close_next();
            }
        }
        scanned
    }

    fn last(&self, cf: Cf, prefix: &[u8]) -> keel_storage::Result<Option<(Vec<u8>, Vec<u8>)>> {
        if let CloseAt::LastEvent = self.at {
            self.close_next();
        }
        self.store.view().last(cf, prefix)
    }

    fn records_lag(&self) -> bool {
        self.store.view().records_lag()
    }
}

#[test]
fn a_run_closing_between_the_status_scans_is_listed_once() {
    // Goal: the scans of a list across statuses are not one snapshot, so a
    // run that closes after the running runs were scanned and before the
    // completed ones is in both; the list still names it once. Method: ten
    // runs, half of them open; a view that closes one open run right after
    // the running runs' scan; every run listed exactly once, newest first.
    for_each_store(|store| {
        let mut open = Vec::new();
        for n in 0..10u64 {
            let run = run_id(5_000 + n);
            let mut b = RunBuilder::new(run, T0 + n * 1_000);
            b.commit(store, vec![started(run, &format!("c-{n}"), TYPES[0])])
                .unwrap();
            if n % 2 == 0 {
                b.commit(store, vec![workflow_completed()]).unwrap();
            } else if n == 5 {
                open.push(b);
            }
        }
        let view = Closing {
            store,
            open: std::cell::RefCell::new(open),
            at: CloseAt::StatusScans { running_only: true },
        };
        let page = search::list(&view, &RunFilter::all(), 100, None).unwrap();
        assert!(view.open.borrow().is_empty(), "the run was closed mid-list");
        let want: Vec<RunId> = (0..10u64).rev().map(|n| run_id(5_000 + n)).collect();
        assert_eq!(ids(&page.runs), want);
    });
}

#[test]
fn runs_closing_all_through_a_list_are_each_listed_once_in_order() {
    // Goal: however commits interleave with the scans of a list across
    // statuses, paging through it names every run once, newest first: a
    // run keeps its place (its start time) when it moves from one status
    // to another. Method: for each page size, 300 runs of a type of their
    // own, most of them open, and a view that closes one of them, in a
    // shuffled order, after every scan of the index by status; the pages
    // compared with the runs sorted by start time and run id.
    for_each_store(|store| {
        let mut rng = Rng(0x00c1_05e5);
        for (i, size) in [1usize, 7, 33, 1000].into_iter().enumerate() {
            let workflow_type = format!("churn-{i}");
            let mut open = Vec::new();
            let mut want = Vec::new();
            for n in 0..300u64 {
                let run = run_id(10_000 + 1_000 * i as u64 + n);
                let at = T0 + rng.below(200) * 1_000;
                let mut b = RunBuilder::new(run, at);
                b.commit(
                    store,
                    vec![started(
                        run,
                        &format!("{workflow_type}-{n}"),
                        &workflow_type,
                    )],
                )
                .unwrap();
                want.push((std::cmp::Reverse(at), run));
                if rng.below(5) == 0 {
                    b.commit(store, vec![closing(rng.below(3))]).unwrap();
                } else {
                    let at = rng.below(open.len() as u64 + 1) as usize;
                    open.insert(at, b);
                }
            }
            want.sort();
            let want: Vec<RunId> = want.into_iter().map(|(_, r)| r).collect();
            let view = Closing {
                store,
                open: std::cell::RefCell::new(open),
                at: CloseAt::StatusScans {
                    running_only: false,
                },
            };
            let filter = RunFilter::all().workflow_type(&workflow_type);
            let mut paged = Vec::new();
            let mut after: Option<PageToken> = None;
            loop {
                let page = search::list(&view, &filter, size, after.as_ref()).unwrap();
                paged.extend(ids(&page.runs));
                match page.next {
                    Some(t) => after = Some(t),
                    None => break,
                }
            }
            assert_eq!(paged, want, "pages of {size}");
        }
    });
}

#[test]
fn a_run_closing_while_its_record_is_caught_up_is_listed_closed() {
    // Goal: where run records lag, a list reads an open run's record and
    // then its last event, not as one snapshot; a run that closes between
    // the two is listed as its closed record says, never as open with the
    // close counted in its history. Method: one run with two signals; a
    // view that commits the run's close just before the last event is
    // read; the listed run equals `run_meta` afterwards (completed, seq 5).
    for_each_store(|store| {
        let run = run_id(7_000);
        let mut b = RunBuilder::new(run, T0);
        b.commit(store, vec![started(run, "torn", TYPES[0])])
            .unwrap();
        for i in 0..2u8 {
            b.commit(store, vec![signal("s", &[i])]).unwrap();
        }
        let view = Closing {
            store,
            open: std::cell::RefCell::new(vec![b]),
            at: CloseAt::LastEvent,
        };
        let filter = RunFilter::all().workflow_type(TYPES[0]);
        let page = search::list(&view, &filter, 10, None).unwrap();
        let listed = page.runs.iter().find(|m| m.run_id == run).expect("listed");
        if store.view().records_lag() {
            assert!(view.open.borrow().is_empty(), "closed mid-list");
            assert_eq!(listed, &store.run_meta(run).unwrap().unwrap());
            assert_eq!(
                (listed.status, listed.next_seq),
                (RunStatus::Completed, Seq(5))
            );
        } else {
            // Read whole, as written: the record before the close.
            assert_eq!(
                (listed.status, listed.next_seq),
                (RunStatus::Running, Seq(4))
            );
        }
    });
}
