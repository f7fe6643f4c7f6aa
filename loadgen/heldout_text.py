"""Held-out English for the trained-model agreement (benchmarks/gguf_agreement.py
``--trained``): ten paragraphs of original prose on everyday topics, each scored as its own
teacher-forced sequence. Never part of the training text (engine/loading/tiny_training.py trains
on docs/*.md), nor of ``loadgen.teacher_forced.TEXT``: plain ASCII, no code, no markdown."""

from __future__ import annotations

HELD_OUT: tuple[str, ...] = (
    "On Thursdays the market town woke before the church clock had finished striking five. "
    "Farmers backed their vans into the square and unfolded trestle tables under striped "
    "awnings, while the woman who sold cheese argued cheerfully with the man who sold honey "
    "about whose turn it was to use the water tap. By eight the stalls were full: crates of "
    "leeks still dusted with soil, trays of brown eggs, bundles of rhubarb tied with string, "
    "and a long table of secondhand tools whose owner could name the workshop each one had "
    "come from. Old men sat on the bench by the war memorial and reported the prices to one "
    "another as if they were news from a distant country. Children were sent with a list and a "
    "purse and came back with half of one and none of the other. At noon the baker's boy walked "
    "through with a basket of warm rolls, and for a few minutes the whole square smelled of "
    "bread. When the stalls came down in the afternoon, the pigeons took over, and the sweeper "
    "followed them slowly with his broom.",

    "We set off downstream in a borrowed canoe with two paddles, a tin of biscuits and a map "
    "that had been folded so often it was coming apart along the creases. For the first hour "
    "the river was narrow and quick, running between alders whose roots reached into the water "
    "like the fingers of a hand. Then the banks fell back, the current slowed, and we drifted "
    "past meadows where cattle stood knee deep and watched us with no particular interest. A "
    "heron lifted from the reeds ahead of us, flew a hundred yards, landed, and waited until we "
    "caught up, then did the same again, as if it had been hired to show us the way. We ate "
    "lunch on a gravel bar beneath a stone bridge and listened to the traffic passing overhead, "
    "strangely far away. In the late afternoon the wind turned against us and every stroke "
    "seemed to win only a few feet. We reached the mill at dusk, tired and sunburned, and agreed "
    "that it had been the best day of the summer.",

    "The baker's alarm rang at half past three, though she was usually awake a minute before "
    "it. She dressed in the dark, crossed the yard, and let herself into the bakehouse, where "
    "the air still held a little of yesterday's warmth. The first task was always the same: "
    "light the oven and feed the starter, a pale sour paste that her grandmother had begun long "
    "ago and that had never once been allowed to die. While the oven heated she weighed flour, "
    "salt and water by lamplight and mixed the dough with her forearms, folding and turning "
    "until it grew smooth and elastic under her hands. Then came the waiting, which she filled "
    "with sweeping, with scrubbing trays and with a mug of strong tea drunk standing up. By six "
    "the loaves were shaped and scored, and she slid them onto the hot stone with a long wooden "
    "peel. When the first customer tapped on the window, the shelves were full, the crusts were "
    "crackling as they cooled, and she had already been working for three hours.",

    "The chess club met every Tuesday evening in the upstairs room of the community hall, "
    "between the choir, which practised on Mondays, and the watercolour painters, who came on "
    "Wednesdays and complained about the smell of coffee. There were eleven regular members. "
    "The oldest was a retired railway signalman who played only the opening he had learned as "
    "a boy and won with it more often than anyone could explain. The youngest was a girl of "
    "twelve who arrived with a notebook full of puzzles and solved them while waiting for her "
    "opponent to move. Games were played in near silence, broken by the click of the clocks and "
    "the occasional groan when someone noticed, too late, that a bishop had been left "
    "undefended. At nine o'clock the boards were packed into a cupboard that would not quite "
    "close, and the members walked together to the bus stop, replaying the evening's mistakes "
    "aloud. Nobody ever agreed about what should have happened, and nobody seemed to mind.",

    "All week the forecast had promised a change, and on Saturday it finally arrived. The "
    "morning began bright and still, with a thin haze over the hills and swallows flying high "
    "above the roofs. By eleven a line of grey cloud had appeared in the west, low and flat "
    "along its lower edge, and the air grew heavy and close. The dogs in the lane stopped "
    "barking. Washing was taken in from every garden, and a man on a ladder came down with his "
    "paint pot half full. Just after one o'clock the first drops fell, large and far apart, each "
    "one leaving a dark coin on the dry pavement. Then the rain came all at once, loud on the "
    "slates and running in the gutters, and thunder rolled slowly from one side of the valley "
    "to the other. It lasted less than an hour. Afterwards the whole town smelled of wet earth "
    "and warm stone, the sky cleared to a pale and washed blue, and the swallows came back as "
    "if nothing had happened.",

    "The library occupied a tall brick building that had once been a corn exchange, and the old "
    "trading floor still had its iron columns and its glass roof. On sunny afternoons the light "
    "fell in long panels across the reading tables, and the regulars moved their chairs to "
    "follow it like cats. The librarian had worked there for twenty six years and could find "
    "almost any book without looking at the catalogue, though she insisted that everyone else "
    "should learn to use it. Students came after school to do their homework and stayed to "
    "read comics in the corner by the radiator. An elderly gentleman arrived at ten every "
    "morning to read three newspapers in a fixed order and left precisely at noon. On the top "
    "gallery, reached by a narrow staircase, were the local history shelves, with parish "
    "records, maps of fields that no longer existed and the diaries of a schoolmaster who had "
    "noted the first cuckoo of every spring for half a century. Hardly anyone climbed up there, "
    "which was exactly why some people did.",

    "My neighbour kept bees at the bottom of his orchard, in six white hives that he had built "
    "himself from old floorboards. He never wore gloves, only a veil pinned to the brim of a "
    "straw hat, and he moved among the hives slowly, talking to the bees in a low voice as if he "
    "were explaining something complicated to a friend. In spring he checked each colony for a "
    "queen and for signs of disease, lifting the frames one by one and holding them up to the "
    "light. In summer he added boxes on top so that the bees would have room to store what they "
    "gathered from the clover and the lime trees. The harvest came at the end of August. He cut "
    "the wax cappings with a heated knife, spun the frames in a hand cranked drum and let the "
    "honey run through a cloth into buckets. Every house in the lane received a jar with a "
    "handwritten label. He said that the bees did all the work and he only did the paperwork.",

    "The night train left the capital a few minutes before eleven, and by the time the "
    "conductor had checked the tickets the city lights had thinned to scattered farms. The "
    "sleeping compartment was barely wider than its two bunks, with a folding basin in the "
    "corner, a small ladder and a blind that rattled whenever the carriage crossed a set of "
    "points. I lay awake for a long while, listening to the wheels and watching stations slide "
    "past the gap at the edge of the blind: a lit platform, an empty bench, a porter pushing a "
    "trolley, and then darkness again. Somewhere after two the train stopped for a long time in "
    "a place with no name, and I could hear men talking outside and the slow clank of wagons "
    "being coupled. I must have fallen asleep then, because the next thing I knew the blind was "
    "glowing orange and a steward was knocking with coffee. Outside were mountains I had only "
    "seen in photographs, their snow catching the first sun.",

    "The allotments lay on a slope behind the school, forty narrow plots divided by grass paths "
    "and water butts. Each one said something about its tenant. One was laid out with string "
    "and a ruler, its onions in rows so straight they might have been planted by a machine. The "
    "next was a cheerful muddle of sunflowers, runner beans and self seeded marigolds, with a "
    "deckchair in the middle that was used more than the spade. An old couple grew nothing but "
    "potatoes and dahlias and had done so for as long as anyone remembered. On summer evenings "
    "people drifted up after work with a trowel or a bag of cuttings and stayed far longer than "
    "they intended, leaning on their forks and discussing slugs, the weather, and the failures "
    "of the previous year. In September there was a show in the hut at the top of the hill, "
    "with prizes for the longest carrot and the heaviest marrow, and a great deal of quiet "
    "rivalry that nobody would ever admit to.",

    "In a narrow shop beside the bridge, a clockmaker repaired watches that other people had "
    "given up on. The window was crowded with mantel clocks, all showing slightly different "
    "times, and a brass bell rang over the door whenever someone came in. He worked at a bench "
    "under a bright lamp, a glass screwed into one eye, taking each movement apart and laying "
    "the pieces in order on a square of green cloth. Some of the springs were finer than a "
    "hair. Customers brought him their grandfathers' pocket watches, alarm clocks that had "
    "stopped in the middle of the night and once a music box that played only the first half "
    "of a waltz. He charged very little and took a long time, and he refused to hurry for "
    "anyone. When a repair was finished he would wind the piece, hold it to his ear and listen "
    "for a full minute before he was satisfied. On the hour, every clock in the shop struck "
    "together, or almost together, and he smiled each time at the ones that were late.",
)
