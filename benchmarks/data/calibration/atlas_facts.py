"""Facts for make_atlas.py other than places: elements, works and their makers,
discoverers, animals' classes, counts, adjectives, participles, female equivalents,
space, colours and SI units.

Written for tokentrail, released under the project's MIT licence: the facts are common
knowledge; the selection and the accepted alternatives are ours (see make_atlas.py).
"""

from __future__ import annotations

from make_knowledge import table

#: Elements facts.jsonl does not ask the symbol of (none whose symbol is a common
#: English word: In, At, No, Am).
SYMBOLS = {
    "scandium": "Sc", "vanadium": "V", "gallium": "Ga", "germanium": "Ge",
    "rubidium": "Rb", "yttrium": "Y", "zirconium": "Zr", "niobium": "Nb",
    "molybdenum": "Mo", "technetium": "Tc", "ruthenium": "Ru", "rhodium": "Rh",
    "palladium": "Pd", "cadmium": "Cd", "tellurium": "Te", "lanthanum": "La",
    "cerium": "Ce", "neodymium": "Nd", "samarium": "Sm", "europium": "Eu",
    "gadolinium": "Gd", "hafnium": "Hf", "tantalum": "Ta", "rhenium": "Re",
    "osmium": "Os", "iridium": "Ir", "thallium": "Tl", "polonium": "Po",
    "francium": "Fr", "actinium": "Ac", "thorium": "Th", "neptunium": "Np",
    "curium": "Cm", "californium": "Cf", "einsteinium": "Es", "fermium": "Fm",
}


#: Accepted spellings of element names besides facts.jsonl's.
ELEMENT_ALSO = {"aluminium": ["aluminum"], "sulfur": ["sulphur"], "cesium": ["caesium"]}


#: Atomic number -> element (the first thirty and some well-known heavier ones).
ATOMIC = {int(n): e for n, (e,) in table("""
1=hydrogen; 2=helium; 3=lithium; 4=beryllium; 5=boron; 6=carbon; 7=nitrogen; 8=oxygen
9=fluorine; 10=neon; 11=sodium; 12=magnesium; 13=aluminium; 14=silicon; 15=phosphorus
16=sulfur; 17=chlorine; 18=argon; 19=potassium; 20=calcium; 21=scandium; 22=titanium
23=vanadium; 24=chromium; 25=manganese; 26=iron; 27=cobalt; 28=nickel; 29=copper
30=zinc; 47=silver; 50=tin; 53=iodine; 79=gold; 80=mercury; 82=lead; 92=uranium
94=plutonium
""").items()}


#: Painting -> its painter's surname (a fuller name where a surname alone is unusual).
PAINTED = table("""
Mona Lisa=Leonardo da Vinci/Leonardo/da Vinci
'The Last Supper' in Milan=Leonardo da Vinci/Leonardo/da Vinci
Lady with an Ermine=Leonardo da Vinci/Leonardo/da Vinci
the ceiling of the Sistine Chapel=Michelangelo
The Starry Night=van Gogh/Gogh; Sunflowers=van Gogh/Gogh; The Potato Eaters=van Gogh/Gogh
Café Terrace at Night=van Gogh/Gogh; The Scream=Munch; Guernica=Picasso
Les Demoiselles d'Avignon=Picasso; The Persistence of Memory=Dalí/Dali
The Birth of Venus=Botticelli; Primavera=Botticelli; Girl with a Pearl Earring=Vermeer
The Night Watch=Rembrandt; The Creation of Adam=Michelangelo; Water Lilies=Monet
Impression, Sunrise=Monet; American Gothic=Grant Wood/Wood
The Great Wave off Kanagawa=Hokusai; The School of Athens=Raphael/Raffaello
The Sistine Madonna=Raphael/Raffaello; The Garden of Earthly Delights=Bosch
Las Meninas=Velázquez/Velazquez; The Arnolfini Portrait=van Eyck/Eyck
Liberty Leading the People=Delacroix; The Son of Man=Magritte
The Treachery of Images=Magritte; Nighthawks=Hopper; Campbell's Soup Cans=Warhol
Marilyn Diptych=Warhol; The Hay Wain=Constable; The Fighting Temeraire=Turner
A Sunday Afternoon on the Island of La Grande Jatte=Seurat
The Third of May 1808=Goya; The Raft of the Medusa=Géricault/Gericault
Olympia=Manet; The Card Players=Cézanne/Cezanne; Broadway Boogie Woogie=Mondrian
The Sleeping Gypsy=Rousseau; The Blue Boy=Gainsborough; The Laughing Cavalier=Hals
Christina's World=Wyeth; The Dance Class=Degas; Wanderer above the Sea of Fog=Friedrich
Luncheon of the Boating Party=Renoir; Bal du moulin de la Galette=Renoir
The Gleaners=Millet; The Angelus=Millet; The Two Fridas=Kahlo; Whaam!=Lichtenstein
The Hunters in the Snow=Bruegel/Brueghel/Breughel
Netherlandish Proverbs=Bruegel/Brueghel/Breughel; The Swing=Fragonard
The Death of Marat=David; The Ambassadors=Holbein
The Calling of Saint Matthew=Caravaggio; Flaming June=Leighton
Washington Crossing the Delaware=Leutze
""")


SCULPTED = table("""
The Thinker=Rodin; the 'Pietà' in St Peter's Basilica=Michelangelo
Little Dancer Aged Fourteen=Degas
""")


#: Musical work -> its composer's surname (common transliterations accepted).
COMPOSED = table("""
Für Elise=Beethoven; the Moonlight Sonata=Beethoven; the Eroica Symphony=Beethoven
The Magic Flute=Mozart; Eine kleine Nachtmusik=Mozart; The Marriage of Figaro=Mozart
Don Giovanni=Mozart; The Four Seasons=Vivaldi
Swan Lake=Tchaikovsky/Tchaikowsky/Chaikovsky/Tschaikowsky
The Nutcracker=Tchaikovsky/Tchaikowsky/Chaikovsky/Tschaikowsky
the 1812 Overture=Tchaikovsky/Tchaikowsky/Chaikovsky/Tschaikowsky
the ballet 'The Sleeping Beauty'=Tchaikovsky/Tchaikowsky/Chaikovsky/Tschaikowsky
the opera 'The Barber of Seville' (1816)=Rossini; the William Tell Overture=Rossini
Carmen=Bizet; Aida=Verdi; La Traviata=Verdi; Rigoletto=Verdi; Nabucco=Verdi
Madama Butterfly=Puccini; Tosca=Puccini; Turandot=Puccini
Ride of the Valkyries=Wagner; Lohengrin=Wagner; The Blue Danube=Strauss
Die Fledermaus=Strauss; the Radetzky March=Strauss; Boléro=Ravel
Clair de lune=Debussy; The Rite of Spring=Stravinsky/Strawinsky
The Firebird=Stravinsky/Strawinsky; The Planets=Holst; Messiah=Handel/Händel/Haendel
Water Music=Handel/Händel/Haendel; the Brandenburg Concertos=Bach
the Goldberg Variations=Bach; The Well-Tempered Clavier=Bach; Rhapsody in Blue=Gershwin
Porgy and Bess=Gershwin; In the Hall of the Mountain King=Grieg
The Carnival of the Animals=Saint-Saëns/Saint-Saens; Danse macabre=Saint-Saëns/Saint-Saens
Pictures at an Exhibition=Mussorgsky/Musorgsky/Moussorgsky
Flight of the Bumblebee=Rimsky-Korsakov/Korsakov/Rimsky-Korsakoff
Peter and the Wolf=Prokofiev/Prokofieff/Prokofjev; Canon in D=Pachelbel
Adagio for Strings=Barber; Gymnopédies=Satie; the Minute Waltz=Chopin
the New World Symphony=Dvořák/Dvorak; Symphonie fantastique=Berlioz
Carmina Burana=Orff; the Surprise Symphony=Haydn; the oratorio 'The Creation'=Haydn
the Hungarian Dances=Brahms; the Hungarian Rhapsodies=Liszt
The Lark Ascending=Vaughan Williams; the Enigma Variations=Elgar
the Pomp and Circumstance Marches=Elgar; Finlandia=Sibelius; The Moldau=Smetana
the Unfinished Symphony=Schubert; the Trout Quintet=Schubert
The Merry Widow=Lehár/Lehar; West Side Story=Bernstein
The Phantom of the Opera=Lloyd Webber/Webber; The Sorcerer's Apprentice=Dukas
""")


#: Question -> the discoverer's, inventor's or explorer's surname.
WHO = table("""
Who discovered penicillin in 1928?=Fleming
Who formulated the three laws of motion?=Newton
Who proposed the theory of evolution by natural selection?=Darwin/Wallace
Who invented the World Wide Web?=Berners-Lee
Who discovered the elements polonium and radium?=Curie
Who introduced printing with movable type to Europe around 1440?=Gutenberg
Who developed the first widely used polio vaccine in the 1950s?=Salk
Who invented the phonograph?=Edison
Which brothers made the first powered aeroplane flight in 1903?=Wright
Who invented dynamite?=Nobel
Who proposed a Sun-centred model of the solar system in 1543?=Copernicus
Who shouted "Eureka!" on discovering the principle of buoyancy?=Archimedes
Who drew up the first periodic table of the elements in 1869?=Mendeleev/Mendeleyev/Mendeleiev
Who discovered the double-helix structure of DNA with Francis Crick?=Watson
Who developed the first vaccine, against smallpox, in 1796?=Jenner
Who discovered X-rays in 1895?=Röntgen/Roentgen/Rontgen
Who led the 1492 voyage across the Atlantic that reached the Americas?=Columbus/Colón/Colombo
Who led the first expedition to sail around the world?=Magellan/Magalhães/Elcano
Who was the first person to travel into space?=Gagarin
Who was the first woman to win a Nobel Prize?=Curie
Who discovered the planet Uranus in 1781?=Herschel
Who discovered the four largest moons of Jupiter in 1610?=Galileo
Who formulated the three laws of planetary motion?=Kepler
Who invented the first electric battery around 1800?=Volta
Who showed that heating liquids kills germs, in a process named after him?=Pasteur
Who discovered the electron in 1897?=Thomson
Who described the circulation of the blood in 1628?=Harvey
Who invented the cotton gin?=Whitney
Who founded genetics with experiments on pea plants?=Mendel
Who formulated the uncertainty principle in quantum mechanics?=Heisenberg
Who built the first petrol-engined motor car in 1885?=Benz
Who discovered insulin in 1921 together with Charles Best?=Banting
Who founded psychoanalysis?=Freud
Who studied conditioned reflexes in dogs that salivated at a bell?=Pavlov
Who led the first expedition to reach the South Pole?=Amundsen
Who first climbed Mount Everest together with Tenzing Norgay in 1953?=Hillary
Who was the first woman to fly solo across the Atlantic?=Earhart
Who flew a kite in a thunderstorm to show that lightning is electricity?=Franklin
Who proposed the model of the atom with electrons in fixed orbits in 1913?=Bohr
Who discovered the atomic nucleus in 1911?=Rutherford
Who discovered the neutron in 1932?=Chadwick
Who was granted the first patent for the telephone in 1876?=Bell
Who co-invented the telegraph code of dots and dashes?=Morse/Vail
Who first sailed from Europe around Africa to India, in 1498?=Gama
Who proposed the theory of continental drift in 1912?=Wegener
Who discovered the dwarf planet Pluto in 1930?=Tombaugh
Who showed in 1929 that distant galaxies are moving away from us?=Hubble
Who invented the alternating-current induction motor in the 1880s?=Tesla/Ferraris
""")


#: Class -> animals of it (the class's name first, then its accepted forms).
CLASSES = {
    ("mammal", "mammals", "Mammalia"): "dolphin; whale; bat; platypus; kangaroo; seal; "
        "walrus; hedgehog; koala; otter; hippopotamus; squirrel; camel",
    ("bird", "birds", "Aves"): "penguin; ostrich; eagle; owl; emu; flamingo; parrot; swan; "
        "sparrow; pelican; peacock; robin",
    ("reptile", "reptiles", "Reptilia"): "snake; crocodile; lizard; turtle; tortoise; "
        "gecko; iguana; chameleon; alligator; Komodo dragon; cobra; python",
    ("amphibian", "amphibians", "Amphibia"): "frog; toad; salamander; newt; axolotl",
    ("fish", "fishes"): "shark; salmon; tuna; seahorse; eel; trout; cod; stingray; piranha",
    ("insect", "insects", "Insecta"): "ant; bee; butterfly; beetle; mosquito; grasshopper; "
        "dragonfly; ladybird; cockroach; wasp; moth; flea; termite",
}


#: Question -> a count (answers: the numeral, with a thousands comma, and in words).
HOW_MANY = {
    "How many sides does a square have?": 4, "How many sides does a pentagon have?": 5,
    "How many sides does a heptagon have?": 7, "How many sides does an octagon have?": 8,
    "How many sides does a nonagon have?": 9, "How many sides does a decagon have?": 10,
    "How many sides does a dodecagon have?": 12,
    "How many degrees are there in a right angle?": 90,
    "How many degrees are there in a full circle?": 360,
    "How many degrees do the angles of a triangle add up to?": 180,
    "How many days are there in a week?": 7, "How many days are there in a fortnight?": 14,
    "How many weeks are there in a year?": 52, "How many months are there in a year?": 12,
    "How many days are there in a year that is not a leap year?": 365,
    "How many seconds are there in a minute?": 60,
    "How many seconds are there in an hour?": 3600,
    "How many minutes are there in a day?": 1440, "How many hours are there in a week?": 168,
    "How many days are there in June?": 30, "How many days are there in January?": 31,
    "How many days does February have in a leap year?": 29,
    "How many years are there in a decade?": 10, "How many years are there in a century?": 100,
    "How many years are there in a millennium?": 1000,
    "How many players does a football (soccer) team have on the pitch?": 11,
    "How many players does a basketball team have on the court?": 5,
    "How many players does an indoor volleyball team have on the court?": 6,
    "How many players does a rugby union team have on the field?": 15,
    "How many players does a baseball team have on the field?": 9,
    "How many players does an ice hockey team have on the ice, goalkeeper included?": 6,
    "How many strings does a standard guitar have?": 6,
    "How many strings does a violin have?": 4,
    "How many keys does a standard piano have?": 88,
    "How many cards are in a standard deck, without jokers?": 52,
    "How many suits are there in a standard deck of cards?": 4,
    "How many squares are there on a chessboard?": 64,
    "How many pieces does each player have at the start of a game of chess?": 16,
    "How many pawns does each player have at the start of a game of chess?": 8,
    "How many faces does a standard die have?": 6,
    "How many natural moons does Earth have?": 1, "How many moons does Mars have?": 2,
    "How many colours are there in a rainbow, traditionally?": 7,
    "How many teeth does a full set of adult human teeth have?": 32,
    "How many chambers does the human heart have?": 4,
    "How many lungs does a human have?": 2,
    "How many chromosomes are in a normal human body cell?": 46,
    "How many legs does a horse have?": 4, "How many legs does a chicken have?": 2,
    "How many arms does an octopus have?": 8,
    "How many arms does a starfish usually have?": 5,
    "How many hearts does an octopus have?": 3,
    "How many humps does a dromedary camel have?": 1,
    "How many humps does a Bactrian camel have?": 2,
    "How many stars are on the flag of the United States?": 50,
    "How many states are in the United States?": 50,
    "How many rings are on the Olympic flag?": 5, "How many wheels does a tricycle have?": 3,
    "How many sides does a stop sign have?": 8,
    "How many centimetres are there in a metre?": 100,
    "How many millimetres are there in a centimetre?": 10,
    "How many grams are there in a kilogram?": 1000,
    "How many metres are there in a kilometre?": 1000,
    "How many inches are there in a foot?": 12, "How many feet are there in a yard?": 3,
    "How many ounces are there in a pound?": 16, "How many pounds are there in a stone?": 14,
    "How many items make a dozen?": 12, "How many items make a baker's dozen?": 13,
    "How many items make a gross?": 144,
    "How many vertices does a cube have?": 8, "How many faces does a cube have?": 6,
    "How many edges does a cube have?": 12,
    "How many holes are played in a standard round of golf?": 18,
    "How many events are there in a decathlon?": 10,
    "How many events are there in a heptathlon?": 7,
    "How many minutes does a football (soccer) match last, without extra time?": 90,
    "How many points is a touchdown worth in American football?": 6,
    "How many innings are there in a standard baseball game?": 9,
    "How many zeros are there in one million written in digits?": 6,
    "How many zeros are there in one billion written in digits?": 9,
    "How many letters are there in the English alphabet?": 26,
    "How many bits are there in a byte?": 8, "How many Great Lakes are there?": 5,
}


#: Adjective -> its comparative and superlative ('/' between alternatives, '_' a space).
COMPARE = {
    word: ([a.replace("_", " ") for a in comp.split("/")],
           [a.replace("_", " ") for a in sup.split("/")])
    for word, comp, sup in (entry.split() for entry in """
good better best; bad worse worst; far farther/further farthest/furthest
little less/littler least/littlest; many more most; much more most
old older/elder oldest/eldest; big bigger biggest; happy happier happiest
easy easier easiest; hot hotter hottest; thin thinner thinnest; fat fatter fattest
sad sadder saddest; wet wetter wettest; large larger largest; nice nicer nicest
simple simpler simplest; busy busier busiest; early earlier earliest
heavy heavier heaviest; pretty prettier prettiest; funny funnier funniest
dry drier/dryer driest; angry angrier angriest; lazy lazier laziest; fit fitter fittest
red redder reddest; young younger youngest; wide wider widest
beautiful more_beautiful most_beautiful; expensive more_expensive most_expensive
important more_important most_important; difficult more_difficult most_difficult
""".replace("\n", ";").split(";") if entry.strip())
}


#: Irregular verbs -> past participle (none whose participle is the verb itself: come,
#: run, put, ...).
PARTICIPLE = table("""
go=gone; eat=eaten; see=seen; take=taken; write=written; swim=swum; drink=drunk
sing=sung; begin=begun; give=given; fly=flown; draw=drawn; speak=spoken; break=broken
choose=chosen; freeze=frozen; steal=stolen; drive=driven; ride=ridden; know=known
grow=grown; throw=thrown; fall=fallen; forget=forgotten; hide=hidden; wear=worn
ring=rung; sink=sunk; shrink=shrunk/shrunken; tear=torn; bite=bitten; shake=shaken
wake=woken; rise=risen; forgive=forgiven; show=shown/showed; blow=blown; do=done
be=been; get=got/gotten; beat=beaten; swear=sworn; spring=sprung; stink=stunk
sew=sewn/sewed; mow=mown/mowed; prove=proven/proved; swell=swollen/swelled
weave=woven; tread=trodden/trod; forbid=forbidden; withdraw=withdrawn; arise=arisen
mistake=mistaken
""")


#: Word -> its female equivalent (none that knowledge.jsonl asks as an opposite: king,
#: brother, uncle).
FEMININE = table("""
actor=actress; waiter=waitress; prince=princess; duke=duchess; emperor=empress
host=hostess; heir=heiress; lion=lioness; tiger=tigress; god=goddess
steward=stewardess; count=countess; baron=baroness; hero=heroine; nephew=niece
husband=wife; son=daughter; father=mother; grandfather=grandmother; monk=nun
wizard=witch; sorcerer=sorceress; widower=widow; bridegroom=bride
gentleman=lady/gentlewoman; lord=lady; master=mistress; headmaster=headmistress
landlord=landlady; policeman=policewoman; fiancé=fiancée/fiancee; masseur=masseuse
abbot=abbess; marquis=marchioness/marquise; sultan=sultana; tsar=tsarina/czarina/tsaritsa
lad=lass; boy=girl; man=woman; bull=cow; stallion=mare; rooster=hen; drake=duck
gander=goose; ram=ewe; boar=sow; stag=hind/doe; buck=doe; fox=vixen; peacock=peahen
cob=pen; billy goat=nanny goat/nanny
""")


#: Space questions with one undisputed short answer.
SPACE = table("""
Which planet is second from the Sun?=Venus
Which planet is third from the Sun?=Earth
Which planet is fourth from the Sun?=Mars
Which planet is fifth from the Sun?=Jupiter
Which planet is sixth from the Sun?=Saturn
Which planet is seventh from the Sun?=Uranus
Which planet is eighth from the Sun?=Neptune
Which planet is farthest from the Sun?=Neptune
Which is the smallest planet in the solar system?=Mercury
What is the largest moon of Saturn?=Titan
What is the largest moon in the solar system?=Ganymede
Which planet spins on its side, with its axis tilted almost flat?=Uranus
Which dwarf planet lost its status as a planet in 2006?=Pluto
What is the name of the galaxy that contains our solar system?=Milky Way
What is the nearest star to the Sun?=Proxima Centauri/Proxima
Which planet has the storm called the Great Red Spot?=Jupiter
Which planet is the brightest in the night sky?=Venus
Which planet is often called Earth's twin?=Venus
Phobos and Deimos are moons of which planet?=Mars
Triton is the largest moon of which planet?=Neptune
Io and Europa are moons of which planet?=Jupiter
What is the name of Pluto's largest moon?=Charon
What is the nearest large spiral galaxy to the Milky Way?=Andromeda
What was the first artificial satellite, launched in 1957?=Sputnik
Which mission first landed people on the Moon, in 1969?=Apollo 11/Apollo
""")


#: Colour questions with one undisputed short answer.
COLOUR = table("""
What colour do you get by mixing red and yellow?=orange
What colour do you get by mixing red and blue?=purple/violet
What colour do you get by mixing red and white?=pink
What colour do you get by mixing black and white?=grey/gray
What colour is a ripe banana?=yellow
What colour is chlorophyll?=green
What colour is a clear daytime sky?=blue
What colour is fresh snow?=white
What colour is an emerald?=green
What colour is a ruby?=red
What colour is a sapphire, usually?=blue
What colour is coal?=black
What colour on a traffic light means stop?=red
What colour on a traffic light means go?=green
What colour is the circle on the flag of Japan?=red
What colour is the maple leaf on the flag of Canada?=red
What colour is the cross on the flag of Switzerland?=white
What colour is the cross on the flag of Finland?=blue
What colour is the cross on the flag of Denmark?=white
What colour is the star on the flag of Vietnam?=yellow/gold
What colour are the stars on the flag of China?=yellow/gold
What colour is a flamingo?=pink
What colour is an amethyst?=purple/violet
What colour does blue litmus paper turn in acid?=red
What colour does red litmus paper turn in an alkali?=blue
What colour is the Statue of Liberty?=green
What colour are American school buses?=yellow
What colour are London's double-decker buses, traditionally?=red
""")


#: SI units.
UNIT = table("""
What is the SI unit of force?=newton/newtons; What is the SI unit of energy?=joule/joules
What is the SI unit of power?=watt/watts
What is the SI unit of electric current?=ampere/amperes/amp/amps
What is the SI unit of frequency?=hertz; What is the SI unit of voltage?=volt/volts
What is the SI unit of electrical resistance?=ohm/ohms
What is the SI unit of pressure?=pascal/pascals
What is the SI base unit of temperature?=kelvin/kelvins
What is the SI base unit of mass?=kilogram/kilograms/kg
What is the SI base unit of length?=metre/metres/meter/meters
What is the SI base unit of amount of substance?=mole/moles/mol
What is the SI base unit of luminous intensity?=candela/candelas
What is the SI unit of electric charge?=coulomb/coulombs
What is the SI unit of capacitance?=farad/farads
What is the SI unit of magnetic flux density?=tesla/teslas
""")
